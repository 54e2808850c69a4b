"""ProPD on SmolLM2 with a tree drafter: pruning rate, tau, exactness, verification time (under load)."""
import json, sys, time, torch
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)
import flashmm
from tools.corpus.build import load_target
model, tok = load_target("smollm2")
rows = [json.loads(l) for l in open(ROOT.parent / "shared/data/spec_bench/question_dev.jsonl")]
picked, seen = [], set()
for r in rows:
    if r["category"] not in seen:
        seen.add(r["category"]); picked.append(r)
picked = picked[: int(sys.argv[1]) if len(sys.argv) > 1 else 4]
N = 48
prompts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"] for r in picked]
plain = [model.generate(p, max_new_tokens=N, do_sample=False) for p in prompts]
configs = [dict(), dict(prune="propd", prune_layer=8, prune_top_k=8), dict(prune="propd", prune_layer=15, prune_top_k=8),
           dict(prune="propd", prune_layer=15, prune_top_k=3)]
for cfg in configs:
    sm = flashmm.wrap(model, flashmm.drafters.load(str(ROOT) + "/assets/text_drafters/smollm2/fastdraft", tree_width=3, max_draft_tokens=12, adaptive=False), **cfg)
    tot = dict(steps=0, acc=0, drafted=0, pruned=0, verify=0.0, total=0.0, exact=0)
    for p, ref in zip(prompts, plain):
        out = sm.generate(p, max_new_tokens=N, do_sample=False)
        s = sm.last_stats
        tot["steps"] += s.verify_steps; tot["acc"] += s.accepted_tokens; tot["drafted"] += s.drafted_tokens
        tot["pruned"] += s.pruned_tokens; tot["verify"] += s.verify_seconds; tot["total"] += s.total_seconds
        tot["exact"] += int(torch.equal(out, ref))
    print(json.dumps({"config": cfg or "no pruning", "questions": len(prompts),
                      "tau": round((tot["acc"] + tot["steps"]) / tot["steps"], 3),
                      "nodes_per_step_verified": round(tot["drafted"] / tot["steps"], 2),
                      "pruning_rate": round(tot["pruned"] / max(1, tot["pruned"] + tot["drafted"]), 3),
                      "verify_ms_per_step": round(1000 * tot["verify"] / tot["steps"], 1),
                      "total_s": round(tot["total"], 1), "exact": f"{tot['exact']}/{len(prompts)}"}), flush=True)
