"""The markdown report of a run: the hardware line, one table per workload, and the goals.

Cells of timed workloads read `median us (ratio to the floor)`; a `≠` marks a contender
whose results did not agree with the floor's (see measure.agree). The goals are issue 20's
acceptance criteria (with issue 8's, 21's, 22's and 23's), reported against this
run's figures, not asserted. With a baseline
(`--baseline REF`), every workload gets a "before → after" line: the baseline's figure, this
tree's, and their ratio (timed cases: the median of the per-round ratios, both having run in
every round).
"""

from __future__ import annotations

MIB = 1 << 20

def _zero_mlps(r, c):
    return _cell(r, "zero_mlps", "tiny", c, "ratio")


def _sweep_item(r, c):
    return _cell(r, "sweep_item", None, c, "overhead_us")


def _per_edit(r, c):
    return r["workloads"].get("edit_slope", {}).get("summary", {}).get(c, {}).get("ratio")


GOALS = (
    # (key, text (which workload it reads, in brackets), target, how to read it from the results)
    ("fixed", "fixed cost of a trace over plain hooks, 2x2 Linear (us) [fixed: +us]", 30.0,
     lambda r, c: _cell(r, "fixed", "linear", c, "overhead_us")),
    ("save_one", "save one layer, tiny (x plain hooks) [save_one]", 1.03,
     lambda r, c: _cell(r, "save_one", "tiny", c, "ratio")),
    ("save_one_prototype", "save one layer, tiny: us over the prototype contender (each one's +us over "
     "plain hooks, same run) [save_one]", 20.0, lambda r, c: _over_prototype(r, "save_one", "tiny", c)),
    ("save_one_checked", "save one layer, tiny: us over the checked floor (the `checked` contender, named in "
     "--contenders: the mechanism with the checks it cannot do without; no target) [save_one]", None,
     lambda r, c: _over(r, "save_one", "tiny", c, "checked")),
    ("zero_mlps", "zero every MLP + save logits, tiny (x plain hooks) [zero_mlps]", 1.05, _zero_mlps),
    ("save_all", "save every layer, tiny (x plain hooks) [save_all]", 1.05,
     lambda r, c: _cell(r, "save_all", "tiny", c, "ratio")),
    ("sweep_item", "sweep probe: us per item over the floor (done-when bound: 40) [sweep_item: +us]", 30.0,
     _sweep_item),
    ("edit_slope", "cost per edited location, k = 1..12 (x plain hooks' per edit) [edit_slope]", 2.0, _per_edit),
    ("as_module", "a call of edited.as_module()'s module, tiny (x a trace with the same edits) "
     "[as_module]", 1.05,
     lambda r, c: r["workloads"].get("as_module", {}).get("exported", {}).get(c, {}).get("tiny")),
    ("tracer", "warm Tracer, no-op backend (x nullcontext) [tracer]", 2.0,
     lambda r, c: _cell(r, "tracer", "tiny body", c, "ratio")),
    ("import", "`import interlace` over an empty interpreter (ms, wall) [import]", 30.0,
     lambda r, c: r["workloads"].get("import", {}).get("rows", {}).get(c, {}).get("over_empty_wall_ms")),
    ("invokes", "16 invokes (x the plain-hook batch) [invokes]", 1.15,
     lambda r, c: next((row.get(c, {}).get("ratio") for label, row in
                        r["workloads"].get("invokes", {}).get("cases", {}).items() if label.endswith("n=16")), None)),
    ("datasets", "activation collection to disk, 128-token windows, tiny (x the hooks loop writing the "
     "same files) [datasets]", 1.2,
     lambda r, c: next((row.get(c, {}).get("ratio") for label, row in
                        r["workloads"].get("datasets", {}).get("cases", {}).items()
                        if "128 tokens" in label), None)),
    ("wrapped", "wrapped model outside a trace: met = no hooks, own forward; figure = us over the bare "
     "module [wrapped]", None, lambda r, c: _cell(r, "wrapped", None, c, "overhead_us")),
    # issue 21's (the generator route): below plain hooks
    ("save_one_below", "issue 21: save one layer, tiny, in each run (x plain hooks, the worst run) "
     "[save_one]", 0.98, lambda r, c: _worst_run(r, "save_one", "tiny", c)),
    ("zero_mlps_below", "issue 21: zero every MLP + save logits, tiny (x plain hooks) [zero_mlps]", 1.0,
     _zero_mlps),
    ("sweep_item_below", "issue 21: sweep probe, us per item over the floor [sweep_item: +us]", 20.0,
     _sweep_item),
    ("edit_slope_below", "issue 21: cost per edited location (x plain hooks' per edit; read only when "
     "plain hooks' own slope stays within ±25% of its median across the runs) [edit_slope]", 1.5, _per_edit),
)


def _cell(results, workload, label, contender, key):
    cases = results["workloads"].get(workload, {}).get("cases", {})
    if label is None:
        label = next(iter(cases), None)
    return cases.get(label, {}).get(contender, {}).get(key)


def _over_prototype(results, workload, label, contender):
    """us `contender` costs over the prototype contender: the difference of their +us over plain
    hooks (each against the floor of its own process), in the same run."""
    return _over(results, workload, label, contender, "prototype")


def _over(results, workload, label, contender, other):
    """us `contender` costs over contender `other` in the same run (each one's +us over plain
    hooks, against the floor of its own process); None where either is unmeasured."""
    mine, theirs = (_cell(results, workload, label, c, "overhead_us") for c in (contender, other))
    return None if contender == other or mine is None or theirs is None else mine - theirs


def _worst_run(results, workload, label, contender):
    """The highest of a contender's per-run ratios (a goal that must hold in each run)."""
    cell = results["workloads"].get(workload, {}).get("cases", {}).get(label, {}).get(contender, {})
    spread = cell.get("ratio_spread")
    return spread[1] if spread else cell.get("ratio")


def _slope_unsteady(results):
    """Why plain hooks' per-edit slope cannot serve as a yardstick in this run (issue 21: it must
    stay within ±25% of its median across the runs), or None."""
    hooks = results["workloads"].get("edit_slope", {}).get("summary", {}).get("hooks")
    if hooks is None:
        return None
    median, spread = hooks["per_edit_us"], hooks.get("per_edit_us_spread")
    if median <= 0:
        return f"plain hooks' slope is {median:.1f} us per edit"
    if spread and (spread[0] < 0.75 * median or spread[1] > 1.25 * median):
        return (f"plain hooks' slope ran {spread[0]:.1f} to {spread[1]:.1f} us per edit across the runs "
                f"(median {median:.1f})")
    return None


#: Goals read only when the run can resolve them: key -> (results -> why not, or None).
READABLE = {"edit_slope_below": _slope_unsteady}


def goals(results: dict) -> list:
    """[{goal, target, baseline, interlace, twin, nnsight, prototype, met, met_before}] (met:
    the native path's figure; met_before: the baseline's; None where unmeasured)."""
    out = []
    for key, text, target, read in GOALS:
        row = {"goal": key, "text": text, "target": target}
        for c in ("baseline", "interlace", "twin", "nnsight", "prototype"):
            row[c] = read(results, c)
        unreadable = READABLE[key](results) if key in READABLE else None
        if unreadable:
            row["unreadable"] = unreadable
        for c, met in (("interlace", "met"), ("baseline", "met_before")):
            value = row[c]
            row[met] = None if value is None or target is None or unreadable else value <= target
            if key == "wrapped":
                found = results["workloads"].get("wrapped", {}).get("structural", {}).get(c)
                row["structural" if c == "interlace" else "structural_before"] = found
                row[met] = None if found is None else not found
        out.append(row)
    return out


def before_after(results: dict) -> dict:
    """{workload: [{case, before, after, ratio, unit}]}: the baseline's figure against this
    tree's native path, per case (empty without a measured baseline)."""
    if "baseline" not in results["contenders"] or "interlace" not in results["contenders"]:
        return {}
    out = {}
    for name, w in results["workloads"].items():
        rows = []
        if name == "edit_slope" and "summary" in w:
            s = w["summary"]
            if "baseline" in s and "interlace" in s:
                rows.append(_pair("per edit", s["baseline"]["per_edit_us"], s["interlace"]["per_edit_us"], "us"))
        elif "cases" in w:
            for label, row in w["cases"].items():
                b, a = row.get("baseline", {}), row.get("interlace", {})
                if "median_us" in b and "median_us" in a:
                    rows.append({**_pair(label, b["median_us"], a["median_us"], "us"),
                                 "ratio": a.get("vs_baseline", a["median_us"] / b["median_us"]),
                                 "ratio_spread": a.get("vs_baseline_spread")})
        elif "peak" in w:
            b, a = w["peak"].get("baseline"), w["peak"].get("interlace")
            if b is not None and a is not None:
                rows.append(_pair(w["case"], b, a, "bytes"))
        elif "rows" in w:
            key = "over_empty_wall_ms" if name == "import" else "first_ms"
            b, a = w["rows"].get("baseline", {}).get(key), w["rows"].get("interlace", {}).get(key)
            if b is not None and a is not None:
                rows.append(_pair(key, b, a, "ms"))
        if rows:
            out[name] = rows
    return out


def _pair(case, before, after, unit) -> dict:
    return {"case": case, "before": before, "after": after, "unit": unit,
            "ratio": after / before if before and before > 0 else None}


def _spread(pair, digits=2, before=", ", after=""):
    """`, 1.12-1.16`: a figure's min-max over several runs (nothing for one run)."""
    if not pair:
        return ""
    return f"{before}{pair[0]:.{digits}f}-{pair[1]:.{digits}f}{after}"


def _value(value, unit):
    return {"us": _us, "bytes": _bytes}.get(unit, lambda v: f"{v:,.1f} ms")(value)


def _us(value):
    if value is None:
        return "—"
    if value >= 10_000:
        return f"{value / 1e3:,.1f} ms"
    return f"{value:,.1f} us" if value < 100 else f"{value:,.0f} us"


def _bytes(value):
    if value is None:
        return "—"
    return f"{value / MIB:,.2f} MiB" if abs(value) >= MIB // 4 else f"{value / 1024:,.1f} KiB"


def _num(value, digits=2):
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    hw = results["hardware"]
    versions = results.get("versions", {})
    lines = [f"**{hw['line']}**", "",
             "Contenders: " + ", ".join(results["labels"][c] + (f" {versions[c]}" if versions.get(c) else "")
                                        for c in results["contenders"]) + ".", ""]
    for name, why in results["skipped"].items():
        lines.append(f"- skipped {name}: {why}")
    if results["skipped"]:
        lines.append("")
    runs = results["settings"].get("runs", 1)
    if runs > 1:
        lines += [f"Each figure is the median of {runs} whole runs (fresh worker processes each); "
                  "`a-b` beside a ratio is its spread over the runs (min-max).", ""]
    names = results["contenders"]
    workers = results.get("workers") or {}  # {name: pid}; a list of them, one per run, for several runs
    remote = [results["labels"][c] for c in (workers[0] if isinstance(workers, list) else workers) if c in names]
    if remote:
        lines += [f"Timed in worker processes, each against plain hooks and a raw forward timed in its own "
                  f"process in the same rounds: {', '.join(remote)}.", ""]
    labels = results["labels"]
    changes = results.get("before_after", {})
    after = f"{labels['baseline']} → {labels['interlace']}" if changes else ""
    for wname, w in results["workloads"].items():
        lines += [f"### {w['title']}", ""]
        if w.get("goal"):
            lines += [f"*Goal: {w['goal']}.*", ""]
        if "rows" in w:  # import, cold start
            keys = w["columns"]
            lines.append("| " + " | ".join(["contender"] + keys) + " |")
            lines.append("|" + "---|" * (len(keys) + 1))
            for c, row in w["rows"].items():
                cells = ["error" if "error" in row else _num(row.get(k), 1) for k in keys]
                lines.append(f"| {row.get('label', labels.get(c, c))} | " + " | ".join(cells) + " |")
        elif "peak" in w:
            lines.append("| case | " + " | ".join(labels[c] for c in names if c in w["peak"]) + " |")
            lines.append("|" + "---|" * (1 + sum(c in w["peak"] for c in names)))
            lines.append(f"| {w['case']} | " + " | ".join(_bytes(w["peak"][c]) for c in names if c in w["peak"]) + " |")
        else:
            present = [c for c in names if any(c in row for row in w["cases"].values())]
            lines.append("| case | " + " | ".join(labels[c] for c in present) + " |")
            lines.append("|" + "---|" * (len(present) + 1))
            for label, row in w["cases"].items():
                cells = []
                for c in present:
                    cell = row.get(c)
                    if cell is None or "error" in cell:
                        cells.append("—" if cell is None else "error")
                        continue
                    text = _us(cell["median_us"])
                    if c != w["floor"] and cell.get("ratio") is not None:
                        text += f" ({cell['ratio']:.2f}x{_spread(cell.get('ratio_spread'))})"
                    if cell.get("agrees") is False:
                        text += " ≠"
                    cells.append(text)
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            if "summary" in w:
                lines.append("")
                for c, s in w["summary"].items():
                    lines.append(f"- {labels[c]}: {s['per_edit_us']:.1f} us per edit"
                                 + _spread(s.get("per_edit_us_spread"), 1, " (runs: ", ")")
                                 + (f" ({s['ratio']:.2f}x plain hooks')" if s.get("ratio") is not None else ""))
            if "per_item" in w:
                lines.append("")
                for c, p in w["per_item"].items():
                    if c == w["floor"]:
                        raw = p.get("over_raw_us")
                        lines.append(f"- {labels[c]}: {p['us']:.1f} us per item (the floor)"
                                     + ("" if raw is None else f", {raw:+.1f} us per item over the raw forward"))
                    else:
                        lines.append(f"- {labels[c]}: {p['over_floor_us']:+.1f} us per item over the floor "
                                     f"({p['floor_us']:.1f} us per item"
                                     + (", in its own process)" if p.get("own") else ")"))
            if "exported" in w:
                lines.append("")
                for c, quotients in w["exported"].items():
                    lines.append(f"- {labels[c]}: a call of the as_module() module over a trace with the "
                                 f"same edits: " + ", ".join(f"{shape} {q:.2f}x" for shape, q in quotients.items()))
            if "structural" in w:
                lines.append("")
                for c, found in w["structural"].items():
                    lines.append(f"- {labels[c]} outside a trace: "
                                 + ("no hooks, the module's own forward" if not found else "; ".join(found[:4])))
        if wname in changes:
            lines += ["", f"- before → after ({after}): " + "; ".join(
                f"{c['case']} {_value(c['before'], c['unit'])} → {_value(c['after'], c['unit'])}"
                + ("" if c["ratio"] is None else f" ({c['ratio']:.2f}x{_spread(c.get('ratio_spread'))})")
                for c in changes[wname])]
        lines.append("")
    yes = {True: "yes", False: "**no**", None: "—"}
    before = "baseline" in results["contenders"]
    proto = "prototype" in results["contenders"]
    head = (["goal", "target"] + ([labels["baseline"]] if before else []) + ["interlace", "twin", "nnsight"]
            + (["prototype"] if proto else []) + ["met"])
    lines += ["### Goals (issues 20, 21, 8, 22 and 23; interlace native unless marked)", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in results["goals"]:
        cells = [g["text"], _num(g["target"])]
        if before:
            cells.append(f"{_num(g['baseline'])} ({yes[g['met_before']]})")
        cells += [_num(g["interlace"]), _num(g["twin"]), _num(g["nnsight"])]
        cells += ([_num(g.get("prototype"))] if proto else [])
        cells.append(f"unreadable: {g['unreadable']}" if g.get("unreadable") else yes[g["met"]])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
