"""Our optimizers inside other people's training loops (Hugging Face Trainer, Accelerate, plain
PyTorch). Top layer: may import optim/, models/ and strategies/; nothing below imports it."""
