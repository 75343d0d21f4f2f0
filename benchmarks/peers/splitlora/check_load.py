"""Check that Split_LoRA's loaders take every tensor of an init.pt (make_inputs.py's or run.py's; their loaders
are strict=False): its vocabulary and positions read from the dict, 4 blocks of width 64 with 4 heads.

Run from their SplitLoRA/examples/src (edits.diff applied) with loralib on PYTHONPATH:
  PYTHONPATH=/tmp/peervenv/lib/python3.11/site-packages:. python check_load.py /tmp/peers/run/init.pt
"""
import copy
import sys

import torch
from splitmodel import GPT2Config, GPT2LMModel_Client, GPT2LMModel_Server  # their module, on sys.path

sd = torch.load(sys.argv[1])
vocab, positions = sd["wte.weight"].shape[0], sd["wpe.weight"].shape[0]  # the sizes of the dict given
cfg = GPT2Config(vocab_size_or_config_json_file=vocab, n_positions=positions, n_ctx=positions, n_embd=64, n_layer=4,
                 n_head=4, lora_attn_dim=4, lora_attn_alpha=32, lora_dropout=0.0)
client, server = GPT2LMModel_Client(cfg), GPT2LMModel_Server(cfg)
client.load_weight(copy.deepcopy(sd))
server.load_weight(copy.deepcopy(sd))
matched, mismatched, used = 0, [], set()
for name, tensor in client.transformer_Client.state_dict().items():
    if name in sd:
        matched += 1
        used.add(name)
        if not torch.equal(tensor, sd[name]):
            mismatched.append(name)
for name, tensor in server.transformer_Server.state_dict().items():
    key = name
    if name.startswith("h."):
        parts = name.split(".")
        key = ".".join(["h", str(int(parts[1]) + 3)] + parts[2:])
    if key in sd:
        matched += 1
        used.add(key)
        if not torch.equal(tensor, sd[key]):
            mismatched.append(name)
print("matched", matched, "mismatched", mismatched, "unused", sorted(set(sd) - used))
