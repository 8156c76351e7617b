"""The Markdown result files: ``loadtest/results/opennmt_speed.md``, ``opennmt_quality.md`` and
``opennmt_compare.md``."""

from __future__ import annotations

from .common import OPENNMT, SMOKE_MINUTES

SYSTEMS = ("ours", "opennmt")  # compare's systems, in its tables' order
LABELS = {"ours": "ours", "opennmt": "OpenNMT-py"}


def speed_markdown(res: dict) -> str:
    lines = ["# Training speed: our trainer beside OpenNMT-py " + OPENNMT, ""]
    if res["smoke"]:
        lines += [(f"**SMOKE figures** ({res['minutes']:g} min per run): they show the measurement works; "
                   f"issue 14's acceptance needs runs of {SMOKE_MINUTES:g} minutes and more."), ""]
    lines += [(f"Corpus {res['corpus']}, tokenizers {res['tokenizers']}; {res['minutes']:g} min of wall clock per "
              f"run, {len(res['rounds'])} round(s), alternating; token batches of 3000, {res['threads']} torch "
              f"threads, CPU; {res['machine']}; {res['date']}. Sentences and target tokens (EOS counted) of "
              "the batches trained, over the training time (after start-up: corpus encoding for ours, the "
              "first bucket for OpenNMT); no validation inside the budget. Sents/step tells how full each "
              "system packs its 3000-token batches. A load average over the CPU count means other processes "
              "shared the CPUs: such rounds do not compare the trainers."), "",
              ("| round | order | ours sents/s | OpenNMT sents/s | ours tgt tok/s | OpenNMT tgt tok/s "
               "| ours steps (sents/step) | OpenNMT steps (sents/step) | load avg after ours / OpenNMT "
               "| ours/OpenNMT (sents/s) |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rounds"]:
        o, n = r["ours"], r["opennmt"]
        lines.append(f"| {r['round']} | {r['order']} | {o['sents_per_s']:.1f} | {n['sents_per_s']:.1f} | "
                     f"{o['tgt_tokens_per_s']:.0f} | {n['tgt_tokens_per_s']:.0f} | "
                     f"{o['steps']} ({o['sentences'] / o['steps']:.0f}) | "
                     f"{n['steps']} ({n['sentences'] / n['steps']:.0f}) "
                     f"| {o.get('loadavg_end', '?')} / {n.get('loadavg_end', '?')} "
                     f"| {o['sents_per_s'] / n['sents_per_s']:.2f} |")
    m = res["median"]
    lines.append(f"| **median** | | **{m['ours']['sents_per_s']:.1f}** | **{m['opennmt']['sents_per_s']:.1f}** | "
                 f"**{m['ours']['tgt_tokens_per_s']:.0f}** | **{m['opennmt']['tgt_tokens_per_s']:.0f}** | | | | "
                 f"**{m['ours']['sents_per_s'] / m['opennmt']['sents_per_s']:.2f}** |")
    first = res["rounds"][0]
    lines += ["", f"Parameters: ours {first['ours']['parameters']:,}, OpenNMT {first['opennmt']['parameters']:,}.",
              "", "Made by `loadtest/opennmt_compare.py speed`."]
    return "\n".join(lines) + "\n"


def quality_markdown(res: dict) -> str:
    st = res["opennmt"]["stats"]
    lines = ["# Translation quality: our model beside an OpenNMT-py " + OPENNMT + " RNN", ""]
    if res["smoke"]:
        lines += [("**SMOKE figures**: a short OpenNMT training and/or a subset of sentences; they show the "
                   "pipeline works, they are not issue 14's acceptance figures."), ""]
    train_min = st.get("train_s", 0) / 60
    lines += [(f"Corpus {res['corpus']}, beam {res['beam']}, placeholders protected for both (our tokenizer) "
               "and restored as `nmt evaluate` does; sacreBLEU and chrF against the catalog translations "
               "(tgt_raw), scored by export/evaluate/evaluate.py `scores`."), "",
              (f"OpenNMT: `{res['opennmt']['checkpoint']}`, {st.get('parameters', 0):,} parameters, "
               f"{st.get('steps', '?')} steps, {train_min:.1f} min of training "
               f"({st.get('sents_per_s', 0):.1f} sents/s).")]
    if res["ours"]:
        o = res["ours"]
        ts = o["train_state"]
        lines.append(f"Ours: `{o['checkpoint']}`, {o['parameters']:,} parameters, {ts.get('step', '?')} steps, "
                     f"{ts.get('elapsed', 0) / 60:.1f} min of training"
                     f"{'' if o['same_tokenizers'] else ' (WARNING: other SentencePiece models)'}.")
        ours_min = ts.get("elapsed", 0) / 60
        if abs(ours_min - train_min) > 0.1 * max(ours_min, train_min):
            lines.append(f"**Not the same wall time** ({train_min:.1f} against {ours_min:.1f} min): this table "
                         "does not decide the acceptance.")
    lines += ["", ("| split | sentences | system | BLEU | chrF | BLEU w/o placeholders | BLEU unseen "
                   "| BLEU normalized | placeholders kept | seconds |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for split, row in res["splits"].items():
        for who, label in (("ours", "ours"), ("opennmt", "OpenNMT-py")):
            if who in row:
                r = row[who]
                lines.append(f"| {split} | {row['sentences']} | {label} | {r['bleu']} | {r['chrf']} | "
                             f"{r['bleu_without_placeholders']} | {r['bleu_unseen']} | {r['bleu_normalized']} | "
                             f"{r['placeholders_kept']:.2%} | {r['seconds']} |")
    lines += [""] + unknown_lines(res["splits"]) + ["Made by `loadtest/opennmt_compare.py evaluate`."]
    return "\n".join(lines) + "\n"


NAMES = {"ours": "ours", "opennmt": "OpenNMT-py"}


def unknown_lines(splits: dict) -> list[str]:
    """Characters with no vocabulary piece: how many runs each split's sources hold, and the share
    of them each system's translations keep (issue 30, item 4)."""
    parts = []
    for split, row in splits.items():
        runs = row["ours"].get("unknown_runs")
        if runs:
            kept = ", ".join(f"{label} {row[w]['unknown_kept']:.0%}" for w, label in NAMES.items()
                             if w in row and row[w].get("unknown_kept") is not None)
            parts.append(f"{split} {runs} run(s), kept by {kept}")
    if not parts:
        return []
    return ["Characters with no vocabulary piece (protected as placeholders are): " + "; ".join(parts) + ".", ""]


def machine_line(box: dict) -> str:
    flags = ", ".join(box["flags"]) or "none of avx2, avx512f, VNNI, AMX"
    return (f"{box['cores']} CPUs ({box['cpu']}), flags {flags}; load average (1 min) {box['load_start']} "
            f"before the first run, {box['load_end']} after the last")


def table(rows: dict[str, dict], splits: list[str], diff: dict) -> list[str]:
    """One system per line, then the differences ours - OpenNMT-py on the scores."""
    head = "| system | updates | sentences/s | target tokens/s | minutes used | load before / after |"
    head += "".join(f" {s} BLEU | {s} chrF |" for s in splits)
    lines = [head, "|---" * (6 + 2 * len(splits)) + "|"]
    for who in SYSTEMS:
        r = rows[who]
        load = (f"{r['loadavg_before'][0]} / {r['loadavg_after'][0]}" if "loadavg_before" in r else "")
        lines.append(f"| {LABELS[who]} | {r['steps']:g} | {r['sents_per_s']:.1f} | {r['tgt_tokens_per_s']:.0f} | "
                     f"{r['minutes_used']:.2f} | {load} |"
                     + "".join(f" {r[f'{s}_bleu']} | {r[f'{s}_chrf']} |" for s in splits))
    lines.append("| ours − OpenNMT-py | | | | | |"
                 + "".join(f" **{diff[s]['bleu']:+.2f}** | **{diff[s]['chrf']:+.2f}** |" for s in splits))
    return lines


def round_rows(res: dict) -> dict[str, dict]:
    """A round's runs with their scores flattened as the medians are (``test_bleu``, ...)."""
    return {who: dict(res["runs"][who], **{f"{s}_{k}": row[who][k] for s, row in res["splits"].items()
                                            for k in ("bleu", "chrf")}) for who in SYSTEMS}


def continued_lines(plan: dict) -> list[str]:
    if not plan.get("continued"):
        return []
    ours, peer = plan["continued"]
    return [f"**Continued runs:** each system's run is a finished shorter run trained on until {plan['minutes']:g} "
            f"minutes of training in all: ours `{ours}` by `nmt train --resume` (its batches and optimizer "
            f"resume where they stopped), OpenNMT-py `{peer}` by `train_from` with its optimizer "
            "(`reset_optim none`), its deterministic batches replayed and skipped up to where the run "
            "stopped (checked against the batches, sentences and target tokens it counted). Updates, "
            "sentences/s and minutes count both parts; the load columns are the second part's.", ""]


def compare_markdown(res: dict) -> str:
    plan, n = res["plan"], len(res["rounds"])
    lines = [f"# Our trainer against OpenNMT-py {OPENNMT}: the same wall time on one machine", ""]
    if res["smoke"]:
        lines += ["**SMOKE figures** (under 10 minutes per run, or a subset of sentences): they show the "
                  "comparison runs; they are not issue 30's acceptance figures.", ""]
    sentences = ", ".join(f"{row['sentences']} {s}" for s, row in res["rounds"][0]["splits"].items())
    extra = " ".join(plan["ours_args"])
    lines += [(f"Corpus {plan['corpus']}, tokenizers {plan['tokenizers']}; {plan['minutes']:g} min of wall clock "
               f"per training run, {plan['threads']} threads, {n} round(s), order alternating (odd rounds ours "
               f"first); our extra arguments: {f'`{extra}`' if extra else 'none'}. Beam {res['beam']}: both "
               f"systems scored by loadtest/opennmt/evaluate.py (export/evaluate/evaluate.py `scores`) on the "
               f"same sentences ({sentences}). Ours: the run's best.pt; OpenNMT-py: its last checkpoint. "
               "Updates, sentences/s and target tokens/s counted as `speed` counts them."), "",
              *continued_lines(plan),
              f"Machine: {machine_line(res['machine'])}; {res['date']}. A load average over the CPU count "
              "means other processes shared the CPUs: such a run does not compare the trainers.", ""]
    for r in res["rounds"]:
        lines += [f"## Round {r['round']} ({' then '.join(LABELS[w] for w in r['order'])})", ""]
        lines += table(round_rows(r), list(r["splits"]), r["differences"]) + [""] + unknown_lines(r["splits"])
    med = res["median"]
    lines += [f"## Medians over {n} round(s)", "", "The difference row is the median of the rounds' differences.", ""]
    lines += table(med, list(med["differences"]), med["differences"])
    lines += ["", f"Reproduce: `{res['command']}`", "", "Made by `loadtest/opennmt_compare.py compare`."]
    return "\n".join(lines) + "\n"
