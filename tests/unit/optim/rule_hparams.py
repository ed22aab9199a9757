"""Hyper-parameters of every rule in the registry for the bit-equality tests of this folder (the
compact state, the exact fp32 program, the Triton step): one copy, so the three compare the same
programs. An anneal_t0 of 10 puts a few steps on both sides of λ(t)'s steep part."""

RULE_HPARAMS = {
    "recadam": dict(lr=1e-3, weight_decay=0.01, anneal_fun="sigmoid", anneal_k=0.1, anneal_t0=10,
                    pretrain_cof=50.0),
    "adamw": dict(lr=1e-3, weight_decay=0.01),
    "bertadam": dict(lr=1e-3, weight_decay=0.01, correct_bias=False),
    "prior_wd": dict(lr=1e-3, weight_decay=0.1),
}
