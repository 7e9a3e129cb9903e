// llmgw portal: a little progressive JavaScript, no build step.
// - the chat page streams answers from /v1/chat/completions (fetch streaming);
// - regions marked data-live refresh in place, unless the person is typing in them;
// - buttons marked data-copy copy a block's text.
(function () {
  "use strict";

  function chat(root) {
    var form = root.querySelector("form.chat-form");
    var log = root.querySelector(".chat-log");
    var key = root.getAttribute("data-key");
    var history = [];
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      var text = form.elements.prompt.value.trim();
      if (!text) { return; }
      var model = form.elements.model.value;
      var option = form.elements.model.selectedOptions[0];
      var limit = parseInt(option.getAttribute("data-max-output") || "0", 10);
      var asked = parseInt(form.elements.max_tokens.value || "0", 10);
      var maxTokens = asked > 0 ? asked : 256;
      if (limit > 0 && maxTokens > limit) { maxTokens = limit; }
      history.push({ role: "user", content: text });
      add("user", text);
      var answer = add("assistant", "");
      form.elements.prompt.value = "";
      form.querySelector("button").disabled = true;
      fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Authorization": "Bearer " + key, "Content-Type": "application/json" },
        body: JSON.stringify({ model: model, messages: history, stream: true, max_tokens: maxTokens })
      }).then(function (response) {
        if (!response.ok) {
          return response.json().then(function (doc) {
            throw new Error((doc.error && doc.error.message) || ("HTTP " + response.status));
          });
        }
        var reader = response.body.getReader();
        var decoder = new TextDecoder();
        var buffer = "";
        function pump() {
          return reader.read().then(function (part) {
            if (part.done) { return; }
            buffer += decoder.decode(part.value, { stream: true });
            var lines = buffer.split("\n");
            buffer = lines.pop();
            lines.forEach(function (line) {
              if (line.indexOf("data:") !== 0) { return; }
              var data = line.slice(5).trim();
              if (!data || data === "[DONE]") { return; }
              try {
                var doc = JSON.parse(data);
                var delta = doc.choices && doc.choices[0] && doc.choices[0].delta;
                if (delta && delta.content) { answer.textContent += delta.content; log.scrollTop = log.scrollHeight; }
              } catch (e) { /* a partial line: the next read completes it */ }
            });
            return pump();
          });
        }
        return pump();
      }).then(function () {
        history.push({ role: "assistant", content: answer.textContent });
        answer.setAttribute("data-done", "1");
      }).catch(function (error) {
        answer.className = "msg error";
        answer.textContent = String(error.message || error);
        answer.setAttribute("data-done", "1");
      }).then(function () {
        form.querySelector("button").disabled = false;
      });
    });
    function add(role, text) {
      var item = document.createElement("div");
      item.className = "msg " + role;
      item.textContent = text;
      log.appendChild(item);
      return item;
    }
  }

  function live() {
    var regions = document.querySelectorAll("[data-live]");
    if (!regions.length) { return; }
    setInterval(function () {
      var active = document.activeElement;
      var typing = active && (active.tagName === "INPUT" || active.tagName === "TEXTAREA" || active.tagName === "SELECT");
      if (typing) { return; }  // hold off while the person is editing a form
      fetch(location.href, { credentials: "same-origin" }).then(function (r) {
        return r.ok ? r.text() : null;
      }).then(function (html) {
        if (!html) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html");
        regions.forEach(function (region) {
          var replacement = fresh.getElementById(region.id);
          if (replacement && !region.contains(document.activeElement) && !edited(region)) {
            region.innerHTML = replacement.innerHTML;
          }
        });
      }).catch(function () {});
    }, parseInt(document.body.getAttribute("data-refresh-ms") || "10000", 10));
  }

  // Whether a field in ``region`` holds something the person typed or chose
  // and has not sent yet: then the region is left as it is.
  function edited(region) {
    var fields = region.querySelectorAll("input, textarea, select");
    for (var i = 0; i < fields.length; i++) {
      var field = fields[i];
      if (field.tagName === "SELECT") {
        for (var j = 0; j < field.options.length; j++) {
          if (field.options[j].selected !== field.options[j].defaultSelected) { return true; }
        }
      } else if (field.type !== "hidden" && field.value !== field.defaultValue) {
        return true;
      }
    }
    return false;
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) { return; }
    var block = document.getElementById(button.getAttribute("data-copy"));
    if (block && navigator.clipboard) { navigator.clipboard.writeText(block.textContent); }
  });

  var chatRoot = document.querySelector("[data-chat]");
  if (chatRoot) { chat(chatRoot); }
  live();
})();
