"""Models: where a checkpoint comes from (hub.py), loading it with θ* captured and the init modes (loading.py), LoRA through peft (lora.py)."""
