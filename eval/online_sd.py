"""Online SD on SmolLM2: τ of FastDraft adapting online vs the frozen FastDraft on one stream of dev questions.

Both runs serve the same stream (``--count`` dev Spec-Bench questions, shuffled with ``--seed``,
chat template, greedy, ``--max-new-tokens``), with the same chain drafting (``--k`` tokens per step,
fixed length: the adaptive length would decline most drafts of a weak draft, hiding acceptance).
The online run wraps the draft in flashmm.drafters.OnlineSD, which distils it in process on the
target's distributions at the positions it rejected, as it serves. τ is reported per block of
``--block`` questions; exactness against the target's own greedy generate (cached answers).

Online SD adapts at serving time on the traffic it serves; here that traffic is the dev questions,
which is what the method does, not offline training on the benchmark.

    python -m eval.online_sd --count 40 --block 10 --max-new-tokens 64 --out eval/results/online_sd_smollm2
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import flashmm
from eval.common import machine, markdown_table, write_results
from eval.draft_acceptance import DEFAULT_QUESTIONS, target_answers
from flashmm.drafters import load
from flashmm.drafters.online import OnlineSD
from flashmm.paths import work_dir

DRAFT_DIR = "assets/text_drafters/smollm2/fastdraft"


def stream(path: Path, count: int, seed: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    random.Random(seed).shuffle(rows)
    return rows[:count]


def serve(model, drafter, items: list[dict], max_new_tokens: int, state: Path, deadline: float, log) -> list[dict]:
    """Greedy spec decoding of the items in order with one drafter; per-question counters.

    Resumable: after every question the records (and an OnlineSD's learner) are saved to ``state``;
    a later call continues from there. Stops after the question that passes ``deadline``
    (time.time()), returning what is done."""
    out = []
    if state.exists():
        saved = torch.load(state, weights_only=True)
        out = saved["records"]
        if isinstance(drafter, OnlineSD):
            drafter.learner.load_state_dict(saved["learner"])
        log(f"resumed {state} at question {len(out)}")
    sm = flashmm.wrap(model, drafter)
    for i in range(len(out), len(items)):
        if time.time() > deadline:
            break
        item = items[i]
        ids = torch.tensor([item["prompt"]])
        t0 = time.perf_counter()
        tokens = sm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        seconds = time.perf_counter() - t0
        s = sm.last_stats
        record = dict(question_id=item["question_id"], category=item["category"], new_tokens=s.new_tokens,
                      verify_steps=s.verify_steps, accepted=s.accepted_tokens, drafted=s.drafted_tokens,
                      seconds=seconds, exact=tokens == item["answer"])
        if isinstance(drafter, OnlineSD):
            record["updates"] = drafter.learner.version
        out.append(record)
        saved = dict(records=out)
        if isinstance(drafter, OnlineSD):
            saved["learner"] = drafter.learner.state_dict()
        torch.save(saved, state.with_suffix(".tmp"))
        state.with_suffix(".tmp").replace(state)
        log(f"{i + 1}/{len(items)} {item['category']}: tau {s.tau:.2f}, exact {record['exact']}, {seconds:.1f} s"
            + (f", updates {record['updates']}" if "updates" in record else ""))
    return out


def summary(records: list[dict]) -> dict:
    steps = sum(r["verify_steps"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    drafted = sum(r["drafted"] for r in records)
    return dict(tau=(accepted + steps) / steps if steps else 0.0, acceptance=accepted / drafted if drafted else 0.0,
                exact=sum(r["exact"] for r in records) / len(records), seconds=sum(r["seconds"] for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="drafted tokens per step (fixed)")
    parser.add_argument("--seed", type=int, default=0, help="shuffles the stream")
    parser.add_argument("--divergence", default="fkl")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--update-every", type=int, default=32)
    parser.add_argument("--steps-per-update", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=work_dir("online_sd", "plain_answers.json"))
    parser.add_argument("--work", type=Path, default=work_dir("online_sd"), help="resumable state of the runs")
    parser.add_argument("--max-minutes", type=float, default=18.0, help="stop (resumable) after this long")
    parser.add_argument("--runs", nargs="+", default=["frozen", "online"], choices=["frozen", "online"],
                        help="which runs to advance (two processes can advance one each); the table needs both")
    parser.add_argument("--out", default="eval/results/online_sd_smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tools.corpus.build import load_target  # noqa: PLC0415

    model, tokenizer = load_target("smollm2")
    args.cache.parent.mkdir(parents=True, exist_ok=True)
    items = target_answers(model, tokenizer, stream(args.questions, args.count, args.seed), args.max_new_tokens,
                           args.cache)
    options = dict(divergence=args.divergence, lr=args.lr, update_every=args.update_every,
                   steps_per_update=args.steps_per_update, capacity=args.capacity)
    deadline = time.time() + args.max_minutes * 60
    work = args.work / f"n{args.count}_s{args.seed}_t{args.max_new_tokens}_k{args.k}"
    work.mkdir(parents=True, exist_ok=True)
    tag = "_".join(f"{k}{v}" for k, v in options.items())
    records = {"frozen": [], "online": []}
    if "frozen" in args.runs:
        records["frozen"] = serve(model, load(DRAFT_DIR, max_draft_tokens=args.k, adaptive=False), items,
                                  args.max_new_tokens, work / "frozen.pt", deadline, print)
    online = OnlineSD(load(DRAFT_DIR, max_draft_tokens=args.k, adaptive=False), **options)
    if "online" in args.runs:
        records["online"] = serve(model, online, items, args.max_new_tokens, work / f"online_{tag}.pt", deadline,
                                  print)
    if "frozen" not in args.runs or "online" not in args.runs:
        return
    done = min(len(r) for r in records.values())  # the table covers the questions both runs served
    if done < len(items):
        print(f"stopped after {args.max_minutes} minutes at {done}/{len(items)} questions; "
              "the same command continues")
    if done == 0:
        return
    records = {name: rs[:done] for name, rs in records.items()}
    blocks = [(b, min(b + args.block, done)) for b in range(0, done, args.block)]
    rows = []
    for a, b in blocks:
        f, o = summary(records["frozen"][a:b]), summary(records["online"][a:b])
        rows.append([f"{a + 1}-{b}", f["tau"], o["tau"], o["tau"] / f["tau"], f["acceptance"],
                     o["acceptance"], f"{f['exact']:.0%} / {o['exact']:.0%}",
                     records["online"][b - 1]["updates"]])
    total = {name: summary(rs) for name, rs in records.items()}
    rows.append(["all", total["frozen"]["tau"], total["online"]["tau"], total["online"]["tau"] / total["frozen"]["tau"],
                 total["frozen"]["acceptance"], total["online"]["acceptance"],
                 f"{total['frozen']['exact']:.0%} / {total['online']['exact']:.0%}", records["online"][-1]["updates"]])
    table = markdown_table(["questions", "τ frozen", "τ online", "online / frozen", "α frozen", "α online",
                            "exact (frozen / online)", "updates so far"], rows)
    history = online.learner.history
    payload = dict(machine=machine(), args={k: str(v) for k, v in vars(args).items()}, records=records,
                   summary=total, learner_history=history)
    last = f", buffer loss at the last update {history[-1]['loss_first']:.3f} → {history[-1]['loss_last']:.3f}" \
        if history else ""
    markdown = (f"# Online SD on SmolLM2-135M-Instruct: FastDraft adapting online vs frozen\n\n"
                f"{done} of a stream of {len(items)} dev Spec-Bench questions (shuffled, seed {args.seed}), "
                f"chat template, greedy, "
                f"{args.max_new_tokens} new tokens, chains of {args.k} drafted tokens (fixed length).\n\n"
                f"{table}\n\nα = accepted / drafted tokens. Online: {options}; {len(history)} updates{last}.\n")
    write_results(args.out, payload, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
