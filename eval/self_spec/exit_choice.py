"""Offline exact greedy acceptance of LayerSkip exits on SmolLM2's own corpus answers (not Spec-Bench)."""
import sys, time, torch
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)
from tools.corpus.build import load_target
from flashmm.train.corpus import token_pairs
from flashmm.drafters.layerskip import choose_exit_layer
model, tok = load_target("smollm2")
pairs = token_pairs(str(ROOT) + "/assets/corpus/smollm2", "greedy")[-12:]  # last prompts of the corpus
seqs = [torch.tensor((p + a)[:len(p) + 160]) for p, a in pairs]
starts = [len(p) - 1 for p, a in pairs]
t = time.time()
choices = choose_exit_layer(model, seqs, exits=[4, 8, 12, 16, 20, 24, 26, 28], draft_tokens=(1, 2, 3, 4, 6), starts=starts)
print(f"{time.time()-t:.0f}s, {sum(len(s) for s in seqs)} positions")
for c in sorted(choices, key=lambda c: (c.exit_layer, c.draft_tokens)):
    print(f"E={c.exit_layer:2d} k={c.draft_tokens} agree={c.agreement:.3f} tau={c.tau:.2f} cost={c.draft_cost:.2f} est={c.speedup:.2f}")
print("best:", choices[:3])
