"""RecAdam in an Accelerate training loop (the same code runs as a plain PyTorch loop when the
Accelerator is left out: skip prepare, call place_anchors on the model as is).

    python examples/accelerate_loop.py --max-steps 20
    accelerate launch examples/accelerate_loop.py --max-steps 20     # DDP / FSDP2 from your config
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _quickstart import Encoded, load_model, read_split  # noqa: E402

from ft_framework.integrations.loops import optimizer_for_model, place_anchors  # noqa: E402
from ft_framework.integrations.transformers import new_parameter_names  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--train-examples", type=int, default=64)
    a = p.parse_args(argv)

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, tokenizer, info = load_model()
    opt, theta_star = optimizer_for_model("recadam", model, new_parameters=new_parameter_names(model, info),
                                          lr=a.lr, anneal_fun="sigmoid", anneal_k=0.5, anneal_t0=10,
                                          pretrain_cof=5000)
    loader = torch.utils.data.DataLoader(Encoded(read_split("train", a.train_examples), tokenizer),
                                         batch_size=8, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    # theta* after prepare, the way ft-train's strategies place it (sharded under FSDP2).
    place_anchors(accelerator.unwrap_model(model), opt, theta_star)
    anchored = sorted(theta_star)
    del theta_star

    model.train()
    step, losses = 0, []
    while step < a.max_steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            step += 1
            if step >= a.max_steps:
                break
    inner = opt.optimizer
    result = {"steps": step, "loss_first": losses[0], "loss_last": losses[-1], "impl": inner.impl,
              "forgetting_distance": inner.forgetting_distance(), "lambda": inner.current_lambdas()[0],
              "anchored": len(anchored)}
    accelerator.print(result)
    result.update(model=accelerator.unwrap_model(model), optimizer=inner, anchored_names=anchored)
    return result


if __name__ == "__main__":
    main()
