"""Inputs for FDU-INC/Split_LoRA's gpt2_ft_sfl.py at a tiny size (see README.md).

Writes init.pt (a random HF GPT2Model state dict, 4 blocks, width 64, 4 heads; keys without the "transformer."
prefix, which their load_weight needs) and train{0,1,2}.jsonl / valid.jsonl in their format ({"context": ids,
"completion": ids}), one client per Debian fortune category, ids = UTF-8 bytes (first half context, second half
completion). Usage: python make_inputs.py OUT_DIR SEED
"""
import json, torch, sys
from transformers import GPT2Config, GPT2Model
out = sys.argv[1]; seed = int(sys.argv[2])
torch.manual_seed(seed)
m = GPT2Model(GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=1024, vocab_size=50257))
torch.save({k: v.clone() for k, v in m.state_dict().items()}, f"{out}/init.pt")
cats = ["computers", "science", "people"]
def enc(t): return [b for b in t.encode("utf-8")][:60]
for i, c in enumerate(cats):
    recs = [r.strip() for r in open(f"/usr/share/games/fortunes/{c}", encoding="utf-8", errors="replace").read().split("\n%\n") if r.strip()]
    with open(f"{out}/train{i}.jsonl", "w") as f:
        for r in recs[:200]:
            ids = enc(r); k = len(ids) // 2
            f.write(json.dumps({"context": ids[:k], "completion": ids[k:]}) + "\n")
with open(f"{out}/valid.jsonl", "w") as f:
    for c in cats:
        recs = [r.strip() for r in open(f"/usr/share/games/fortunes/{c}", encoding="utf-8", errors="replace").read().split("\n%\n") if r.strip()]
        for r in recs[200:240]:
            ids = enc(r); k = len(ids) // 2
            f.write(json.dumps({"context": ids[:k], "completion": ids[k:]}) + "\n")
print(sorted(m.state_dict())[:8])
