#!/usr/bin/env python3
"""A decode-step timeline (osprey bench decode --timeline) laid out by layer, or two of them side by
side, so that a change's effect on each kernel of each layer reads at a glance.

A family total hides where a change lands: the splits' merge moved into attn_decode saved 10 us a
step in the attention yet cost 93 us in moe_experts, because from the first attention layer on every
GDN in_proj block landed beside the experts (the in_proj's copies went out ~12 us before its
release; in the base only in layers 0-3: bench/results/cuda-decode-attn-merge-in-decode.json).
Per layer this prints each launch's time (its last block's end minus the previous launch's) and,
for a launch with phase marks, mark 2's median block after the release: negative when the launch's
blocks were already resident and asking for their weights before the predecessor finished.

    python3 tools/timeline_layers.py bench/results/cuda-decode-timeline-4k.json
    python3 tools/timeline_layers.py base.json variant.json
"""
import json
import sys

# Short column names for the step's kernel families (the host's launch names); a layer starts at
# its input projection.
SHORT = {
    "gdn in_proj": "in_proj",
    "attn in_proj": "in_proj",
    "gdn step": "gdn_step",
    "gdn gated norm": "out_proj",
    "attn q/k norm": "prep",
    "attn decode": "attn",
    "attn combine": "combine",
    "attn o_proj": "o_proj",
    "moe router": "router",
    "moe experts": "experts",
}


def short_name(kernel):
    for prefix, name in SHORT.items():
        if kernel.startswith(prefix):
            return name
    return None


def layers(timeline):
    """[(kind, [(name, us since the previous launch's end, mark 2's median after release or None,
    "N/BLOCKS" of its blocks started before the previous launch's end or None)])] per layer, in step
    order; launches outside the layers (embed, lm_head, sampling) are left out."""
    out, prev_end = [], None
    for launch in timeline["launches"]:
        end = launch["end_us"]
        name = short_name(launch["kernel"])
        if name is not None and end is not None and prev_end is not None:
            if name == "in_proj":
                out.append(("attn" if launch["kernel"].startswith("attn") else "gdn", []))
            if out:
                mark2 = next((p["median_us"] for p in launch["phases"] if p["mark"] == 2), None)
                early = launch.get("blocks_started_before_predecessor_end")
                landed = None if early is None else f"{early}/{launch['blocks']}"
                out[-1][1].append((name, end - prev_end, mark2, landed))
        if end is not None:
            prev_end = end
    return out


def render(a, b=None):
    """Rows of text: per layer its kind and each launch's time (A, or A -> B with two timelines of
    the same layers; a launch only one of them has shows "-" for the other), in_proj's mark 2 and
    its blocks that landed before the previous launch ended when the timeline has them, and the
    layer's total."""
    la = layers(a)
    lb = layers(b) if b is not None else None
    if lb is not None and [k for k, _ in la] != [k for k, _ in lb]:
        raise ValueError("the two timelines do not have the same layers")
    rows = []
    for i, (kind, launches) in enumerate(la):
        total = sum(us for _, us, _, _ in launches)
        if lb is None:
            cells = [f"{name} {us:5.2f}" + (f" (copies {m2:+.1f})" if name == "in_proj" and m2 is not None else "")
                     + (f" (landed early {e})" if name == "in_proj" and e is not None else "")
                     for name, us, m2, e in launches]
            rows.append(f"{i:2d} {kind:4s} " + "  ".join(cells) + f"  = {total:6.2f}")
            continue
        mine = {name: (us, m2, e) for name, us, m2, e in launches}
        theirs = {name: (us, m2, e) for name, us, m2, e in lb[i][1]}
        names = [n for n, _, _, _ in launches] + [n for n, _, _, _ in lb[i][1] if n not in mine]
        cells = []
        for name in names:
            x, y = mine.get(name), theirs.get(name)
            cell = f"{name} {f'{x[0]:5.2f}' if x else '    -'}->{f'{y[0]:5.2f}' if y else '-'}"
            if name == "in_proj" and x and y and x[1] is not None and y[1] is not None:
                cell += f" (copies {x[1]:+.1f}->{y[1]:+.1f})"
            if name == "in_proj" and x and y and x[2] is not None and y[2] is not None:
                cell += f" (landed early {x[2]}->{y[2]})"
            cells.append(cell)
        other = sum(us for _, us, _, _ in lb[i][1])
        rows.append(f"{i:2d} {kind:4s} " + "  ".join(cells) + f"  = {total:6.2f}->{other:6.2f}")
    return rows


def main(argv):
    if len(argv) not in (1, 2):
        sys.exit(__doc__)
    timelines = []
    for path in argv:
        with open(path) as f:
            timelines.append(json.load(f))
    try:
        rows = render(*timelines)
    except ValueError as e:
        sys.exit(str(e))
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
