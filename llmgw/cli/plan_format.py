"""``llmgw ctl model plan`` for people: a plan as a text table.

The JSON form is :meth:`llmgw.control.planning.Plan.to_doc`; this is the
same plan laid out in columns: the model's facts, the context's KV cache,
one row per GPU layout (memory per card in GiB: total = weights + kv +
engine, of usable; the nodes it fits on or why it does not), one row per
CPU node (host GiB of usable, cores, GB/s, tok/s), the best layout and the
warnings.
"""

from __future__ import annotations

from llmgw.control.planning import GIB, Plan

__all__ = ["format_plan"]


def _gib(value: float) -> str:
    return f"{value:.1f}"


def format_plan(result: Plan) -> str:
    """The plan as a readable text table (GiB, tokens/s), lines joined by
    ``\n`` without a final one."""
    facts = result.facts
    size = facts.weights_bytes / GIB
    lines = [
        f"model      {facts.path}",
        f"           {facts.format} {facts.quantization or '?'}, {facts.architecture}, "
        f"{size:.2f} GiB"
        + (
            f" ({facts.active_weights_bytes / GIB:.2f} active, {facts.experts} experts)"
            if facts.moe
            else ""
        ),
        f"           {facts.layers} layers, {facts.heads} heads, {facts.kv_heads} KV heads "
        f"x {facts.head_dim}, trained context {facts.context_length:,}",
        f"context    {result.context_tokens:,} tokens in {result.slots} slot(s): "
        f"KV {result.kv_gib:.2f} GiB, {result.kv_gib_per_1k_tokens:.3f} GiB per 1,000 tokens",
        "",
    ]
    gpu = [layout for layout in result.layouts if layout.kind == "gpu"]
    cpu = [layout for layout in result.layouts if layout.kind == "cpu"]
    if gpu:
        header = f"{'layout':<34} {'per card GiB':>13} {'= weights':>9} {'+ kv':>6} {'+ engine':>8} {'of usable':>9}  nodes"
        lines.append(header)
        for layout in gpu:
            pc = layout.per_card
            assert pc is not None
            where = ", ".join(layout.nodes) if layout.fits else f"does not fit: {layout.reason}"
            lines.append(
                f"{layout.describe():<34} {_gib(pc.total_gib):>13} {_gib(pc.weights_gib):>9} "
                f"{_gib(pc.kv_gib):>6} {_gib(pc.overhead_gib):>8} {_gib(pc.usable_gib):>9}  {where}"
            )
            if layout.engine_args:
                lines.append(f"{'':<34} engine args: {' '.join(layout.engine_args)}")
        lines.append("")
    if cpu:
        lines.append(
            f"{'CPU node':<20} {'host GiB':>9} {'of usable':>9} {'cores':>5} {'GB/s':>6} {'tok/s':>6}"
        )
        for layout in cpu:
            speed = f"{layout.tokens_per_second:.1f}" if layout.tokens_per_second else "?"
            bandwidth = f"{layout.bandwidth_gbps:.1f}" if layout.bandwidth_gbps else "?"
            note = "" if layout.fits else "  does not fit"
            lines.append(
                f"{layout.nodes[0]:<20} {_gib(layout.host_memory_gib):>9} "
                f"{_gib(layout.host_usable_gib):>9} {layout.cores:>5} {bandwidth:>6} {speed:>6}{note}"
            )
        lines.append(f"CPU profile: min_memory_gb {result.suggested_min_memory_gb}")
        lines.append("")
    lines.append(f"best       {result.best.describe() if result.best else 'nothing fits'}")
    lines.extend(f"warning    {warning}" for warning in result.warnings)
    return "\n".join(lines)
