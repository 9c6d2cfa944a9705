"""Chapter 10's loss check (section 8): do the switches change what the model learns?

`benchmarks.composed_curves` trains a ~325M-parameter LLaMA on real text for 2,000 steps,
naive and with every switch, paired by seed; the naive seeds' spread says how far equally
good runs land apart, and positive controls (changes known to harm) must land outside it
for the check to mean anything. Here: the runs named for readers by what they ran
(`curve_name`), the table, the figure of paired differences against the spread, and the
verdict in words, each computed from the file's rows.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from colossal_lab.book import plot
from colossal_lab.book.composed_view import EXACT, ROUNDED, find_on_record, has_kind
from colossal_lab.book.notebook import table
from colossal_lab.measure import results


def loss_check_on_record() -> results.Results | None:
    """The composed loss check on record (`find_on_record`): the first composed_curves
    file that holds a verdict (a row of kind "loss_check")."""
    return find_on_record("composed_curves", has_kind("loss_check"))

ROLES = {"ours-bf16": "ours, every switch", "variant": "variants",
         "control": "positive controls"}
"""The roles of a loss check's paired runs, in the figure's order, named for readers."""


def curve_name(row: dict) -> str:
    """A loss curve's name by what it ran (precision, optimizer, AdamW's moments), not by
    its setup name: the naive reference, every switch with AdamW exact, with bf16
    moments (stochastically rounded, or rounded to nearest), without fp32 masters
    (torch's AdamW on bf16 parameters), fp8 linears over bf16 or fp32 parameters. A row
    of the older format that matches none keeps its setup name."""
    setup = str(row.get("setup"))
    prec, moments = row.get("precision"), row.get("optimizer_moments")
    if row.get("role") == "naive":
        return "naive: bf16 autocast, eager ops, torch's AdamW"
    if prec == "bf16-pure":
        if row.get("optimizer") == "AdamW":  # torch's, on the bf16 parameters in place
            return "every switch, no fp32 masters"
        if moments == EXACT:
            return "every switch, AdamW exact"
        if moments == "bf16-nearest":
            return "every switch, bf16 moments rounded to nearest"
        if moments == ROUNDED and row.get("role") is not None:
            return "every switch, bf16 moments (stochastic rounding)"
        return f"every switch, {moments} moments"
    if prec == "fp8-pure":
        return "every switch, fp8 linears, bf16 parameters + fp32 masters"
    if prec == "fp8":
        if row.get("role") is not None:
            return "every switch, fp8 linears, fp32 parameters"
        return "every switch, fp8" + (f", {moments} moments" if moments != EXACT else "")
    return setup


def loss_check(res: results.Results) -> dict:
    """The verdict row of a loss check (kind "loss_check")."""
    return next(r for r in res.rows if r.get("kind") == "loss_check")


def loss_table_rows(res: results.Results) -> list[dict]:
    """One row a run of the loss check, in the file's order: its name for readers
    (`curve_name`), seed, validation loss, its difference from the naive run of its
    seed and whether that lies inside the naive seeds' spread (the naive runs: the
    reference). A failed run keeps its `error` (the table's footnote)."""
    paired = loss_check(res).get("paired", {})
    out = []
    for r in res.rows:
        if r.get("kind") != "loss_curve":
            continue
        p = paired.get(r.get("setup"))
        row = {**r, "run": r.get("setup"), "what": curve_name(r)}
        if p is not None:
            row.update(diff=p["diff"], inside="yes" if p["inside_spread"] else "no")
        elif r.get("role") == "naive" and "error" not in r:
            row["inside"] = "the reference"
        out.append(row)
    return out


def loss_table(res: results.Results):
    """`loss_table_rows` as a `notebook.table`."""
    return table(loss_table_rows(res),
                 {"run": None, "what": None, "seed": "d", "val_loss": ".4f",
                  "diff": "+.4f", "inside": None},
                 headers={"run": "run", "what": "what it runs", "val_loss": "val loss",
                          "diff": "Δ vs naive, same seed",
                          "inside": "inside the spread?"})


def loss_check_figure(res: results.Results, title: str):
    """Each paired run's difference in validation loss from the naive run of its seed,
    one point a run, grouped by role (`ROLES`), over the naive seeds' spread drawn as a
    band of ± the spread around 0: a point inside the band is a difference the seeds
    alone make."""
    check = loss_check(res)
    spread = check.get("spread_val_loss")
    curves = {r["setup"]: r for r in res.rows if r.get("kind") == "loss_curve"}
    groups = [(role, [(name, p) for name, p in check.get("paired", {}).items()
                      if p["role"] == role]) for role in ROLES]
    groups = [(role, runs) for role, runs in groups if runs]
    n = sum(len(runs) for _, runs in groups) + len(groups) - 1
    fig, ax = plt.subplots(figsize=(9, 0.32 * n + 1.8), layout="constrained")
    if spread is not None:
        ax.axvspan(-spread, spread, color="#e8e8e8", lw=0,
                   label="± the naive seeds' spread (range of their validation losses)")
    ax.axvline(0, color=plot.GREY, lw=0.8)
    colours = {"ours-bf16": plot.BLUE, "variant": plot.ORANGE, "control": "#c44e52"}
    markers = dict(zip(sorted({p["seed"] for _, runs in groups for _, p in runs}),
                       plot.MARKERS))
    y, ticks, labels = n - 1, [], []
    for role, runs in groups:
        for k, (name, p) in enumerate(runs):
            ax.plot(p["diff"], y, ls="none", marker=markers[p["seed"]], ms=7,
                    color=colours[role], label=ROLES[role] if k == 0 else None)
            ticks.append(y)
            labels.append(f"{curve_name(curves.get(name, {'setup': name}))}, "
                          f"seed {p['seed']}")
            y -= 1
        y -= 1
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(min(ticks) - 0.7, max(ticks) + 0.7)
    lim = max([abs(p["diff"]) for _, runs in groups for _, p in runs] + [spread or 0])
    ax.set_xlim(-lim * 1.25, lim * 1.25)
    ax.set_xlabel("validation loss − the naive run's of the same seed", fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(axis="x", labelsize=8)
    fig.legend(loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


def loss_setup_words(res: results.Results) -> str:
    """The loss check's setup in one sentence, from the file: parameters, layers ×
    width, steps, tokens a step and the share of one epoch of the corpus it trained."""
    r = next(r for r in res.rows if r.get("kind") == "loss_curve" and "error" not in r)
    model = res.config.get("model", {})
    shape = (f" ({model['num_hidden_layers']} layers of width {model['hidden_size']})"
             if "num_hidden_layers" in model else "")
    epochs = f", {r['epochs']:.0%} of one epoch of the corpus" if r.get("epochs") else ""
    return (f"Each run trains a LLaMA of {r['n_params'] / 1e6:.0f}M parameters{shape} for "
            f"{r['steps']:,} steps of {r['batch']} sequences × {r['seq_len']} tokens "
            f"({r['batch'] * r['seq_len']:,} tokens a step{epochs}) at learning rate "
            f"{r['lr']:g}, then measures its loss on the same validation batches.")


def loss_verdict_words(res: results.Results, betas: tuple[float, float] | None = None
                       ) -> list[str]:
    """The verdict in sentences, computed from the check's row: where it holds, that
    the switches do not change what is learned at this scale within the spread, which
    control it flagged and which it did not (for rounding to nearest, with `betas`,
    AdamW's (β1, β2), why it does not show in a run this long); where it does not hold,
    or is not complete, exactly that. Then the named variants, inside or outside."""
    check = loss_check(res)
    curves = {r["setup"]: r for r in res.rows if r.get("kind") == "loss_curve"}
    paired = check.get("paired", {})
    spread = check.get("spread_val_loss")
    name = {k: curve_name(curves.get(k, {"setup": k})) for k in paired}
    steps = next((r["steps"] for r in curves.values() if "steps" in r), None)
    ours = {k: p for k, p in paired.items() if p["role"] == "ours-bf16"}
    controls = {k: p for k, p in paired.items() if p["role"] == "control"}
    flagged = [k for k in check.get("controls_flagged", [])]
    out = []
    if check.get("holds") is None:
        out.append(f"The check is not complete ({check.get('why', 'a part is missing')}): "
                   f"this page draws no conclusion from it yet.")
    elif check["holds"]:
        mean = check.get("ours_bf16_mean_diff")
        diffs = ", ".join(f"{paired[k]['diff']:+.4f}" for k in flagged)
        out.append(
            f"The check holds. Each of the {len(ours)} runs with every switch lands inside "
            f"the naive seeds' spread ({spread:.4f}) of the naive run of its seed (mean "
            f"difference {mean:+.4f}), and the check flagged the control "
            f"{', '.join(f'“{name[k]}”' for k in flagged)} (difference {diffs}): the "
            f"switches do "
            f"not change what this model learns at this scale, within the spread.")
    else:
        outside = [k for k, p in ours.items() if not p["inside_spread"]]
        why = []
        if outside:
            why.append(f"{len(outside)} of the {len(ours)} runs with every switch land "
                       f"outside the naive seeds' spread ({spread:.4f}): "
                       + ", ".join(f"seed {ours[k]['seed']} {ours[k]['diff']:+.4f}"
                                   for k in outside))
        if not flagged:
            why.append("no positive control lands outside the spread, so the check "
                       "cannot tell a harmful change from the seeds' noise")
        out.append("The check does not hold: " + "; ".join(why) + ".")
    for k, p in controls.items():
        if k in flagged or check.get("holds") is False:
            continue
        text = (f"It did not flag the control “{name[k]}” (difference {p['diff']:+.4f}, "
                f"inside the spread).")
        if curves.get(k, {}).get("optimizer_moments") == "bf16-nearest" and betas:
            b1, b2 = betas
            text += (f" Rounding to nearest loses an update to a moment only when the "
                     f"update is under half a bf16 ulp of the moment (2⁻⁹ to 2⁻⁸ of it); each "
                     f"step moves the moments by {1 - b1:.0%} and {1 - b2:.0%} of their "
                     f"gap to the new gradient (or its square), so only an update whose "
                     f"gradient nearly matches the moment already held is lost, and "
                     f"over {steps:,} steps the bias this leaves stays inside the "
                     f"spread.")
        out.append(text)
    variants = {k: p for k, p in paired.items() if p["role"] == "variant"}
    if variants:
        out.append("The variants, each against the naive run of its seed: "
                   + "; ".join(variant_words(name[ks[0]], [variants[k] for k in ks])
                               for ks in _group_by_name(variants, name).values()) + ".")
    return out


def _group_by_name(paired: dict, name: dict) -> dict[str, list[str]]:
    """The paired runs' keys grouped by their name for readers, in file order."""
    groups: dict[str, list[str]] = {}
    for k in paired:
        groups.setdefault(name[k], []).append(k)
    return groups


def variant_words(what: str, runs: list[dict]) -> str:
    """One variant's seeds in a clause: each seed's difference from the naive run of its
    seed, their mean where there are several, and which land outside the spread and on
    which side (a lower loss than naive's is no sign of harm, but it is not inside what
    the seeds explain either)."""
    diffs = ", ".join(f"seed {p['seed']} {p['diff']:+.4f}" for p in runs)
    text = f"{what}: {diffs}"
    if len(runs) > 1:
        text += f" (mean {sum(p['diff'] for p in runs) / len(runs):+.4f})"
    out = [p for p in runs if not p["inside_spread"]]
    if not out:
        return text + (", inside the spread" if len(runs) == 1 else ", all inside the spread")
    low = all(p["diff"] < 0 for p in out)
    high = all(p["diff"] > 0 for p in out)
    side = (", below the naive run's loss" if low else
            ", above the naive run's loss" if high else "")
    seeds = " and ".join(f"seed {p['seed']}" for p in out)
    return text + f", {seeds} outside the spread{side}"
