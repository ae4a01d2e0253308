"""The real HF Trainer (bf16=True) on a tiny random Llama stored in bf16: which dtypes it
trains in, and the peak of live tensor bytes of its second training_step (forward +
backward, with the optimizer states of step one resident) under vramplan's exact meter.

    PYTHONPATH=src python bench/stack/hf_trainer_dtypes.py auto      # from_pretrained default
    PYTHONPATH=src python bench/stack/hf_trainer_dtypes.py float32   # dtype=torch.float32

Compare with `vramplan estimate` of the same job (bench/stack/results.json holds both)."""
import json, sys, tempfile
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments
from vramplan.measure.meter import MemoryMeter

load = sys.argv[1]          # "auto" or "float32"
method = sys.argv[2] if len(sys.argv) > 2 else "full"
cfg = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                  max_position_embeddings=512)
tmp = tempfile.mkdtemp()
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp)
kw = {} if load == "auto" else {"dtype": getattr(torch, load)}
model = AutoModelForCausalLM.from_pretrained(tmp, **kw)
if method == "lora":
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
S, B = 256, 2
data = [{"input_ids": torch.randint(0, 8000, (S,)), "labels": torch.randint(0, 8000, (S,))} for _ in range(8)]
args = TrainingArguments(output_dir=tmp + "/o", bf16=True, use_cpu=True, per_device_train_batch_size=B,
                         max_steps=2, report_to=[], optim="adamw_torch", save_strategy="no",
                         logging_strategy="no", dataloader_num_workers=0, weight_decay=0.01)


class Metered(Trainer):
    meter = None
    steps = 0

    def training_step(self, *a, **k):
        Metered.steps += 1
        if Metered.steps == 2:
            m = Metered.meter = MemoryMeter()
            live = list(self.model.parameters()) + [t for s in self.optimizer.state.values()
                                                    for t in s.values() if isinstance(t, torch.Tensor)]
            live += [p.grad for p in self.model.parameters() if p.grad is not None]
            m.register(live, "resident")
            m.register(list(a[1].values()) if len(a) > 1 else [], "batch")
            with m:
                return super().training_step(*a, **k)
        return super().training_step(*a, **k)


tr = Metered(model=model, args=args, train_dataset=data)
tr.train()
p = next(x for x in model.parameters() if x.requires_grad)
st = tr.optimizer.state[p]
print(json.dumps({"transformers": transformers.__version__, "load": load, "method": method,
                  "param_dtype": str(p.dtype), "base_dtype": str(model.get_input_embeddings().weight.dtype),
                  "exp_avg_dtype": str(st["exp_avg"].dtype),
                  "peak_training_step_bytes": Metered.meter.peak}))
