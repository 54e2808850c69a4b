"""CPU time of one verification forward on SmolLM2: the whole FastDraft tree vs ProPD (1 thread, process time)."""
import json, sys, time, torch
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)
import flashmm
from flashmm.config import SamplingParams, SpecConfig
from flashmm.targets import cache as kv
from flashmm.targets.prune import score_draft
from tools.corpus.build import load_target
model, tok = load_target("smollm2")
rows = [json.loads(l) for l in open(ROOT.parent / "shared/data/spec_bench/question_dev.jsonl")]
drafter = flashmm.drafters.load(str(ROOT) + "/assets/text_drafters/smollm2/fastdraft", tree_width=3, max_draft_tokens=12, adaptive=False)
sm = flashmm.wrap(model, drafter)
target = sm.target
res = {}
for q in rows[:3]:
    ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=20, do_sample=False)  # committed text: prompt + 20 tokens
    _, seq = target.prefill(out[:, :-1], None, False)
    from flashmm.drafters.base import SequenceStart
    drafter.begin(SequenceStart(input_ids=out[:, :-1]))
    draft = drafter.propose(out, 12, SamplingParams(), None)
    prefix = seq.length
    for name, spec in [("whole tree", SpecConfig()), ("propd l=8 k=8", SpecConfig(prune="propd", prune_layer=8)),
                       ("propd l=15 k=8", SpecConfig(prune="propd", prune_layer=15))]:
        times, kept = [], None
        for rep in range(6):
            t = time.process_time()
            verified, scored = score_draft(target, seq, draft, False, spec, SamplingParams())
            times.append(time.process_time() - t)
            kept = verified.tree.num_nodes
            kv.crop(seq.kv, prefix)
        times.sort()
        res.setdefault(name, []).append((draft.tree.num_nodes, kept, 1000 * times[len(times) // 2]))
for name, r in res.items():
    print(name, "nodes/kept/median CPU ms per question:", [(n, k, round(ms, 1)) for n, k, ms in r],
          "mean ms", round(sum(ms for *_, ms in r) / len(r), 1), flush=True)
