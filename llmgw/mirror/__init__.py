"""The model mirror: pinned, immutable versions of model repositories, served
over the part of the Hugging Face Hub's HTTP API that ``huggingface_hub``
uses, so nodes, vLLM and transformers fetch from it with ``HF_ENDPOINT`` and
nothing else changed (docs/mirror.md).

- :mod:`.paths`: the repository ids, revisions and file paths accepted;
- :mod:`.store`: content-addressed blobs and immutable commits on disk, import;
- :mod:`.pull`: one commit copied from the Hub or another mirror, digests checked;
- :mod:`.server`: the HTTP side (hypercorn), range requests, ``/-/stats``.
"""
