"""The Ultra-Scale Playbook's memory formulas as the playbook states them, for checking meshtrain's own
accounting against (planning/memory.py counts the tensors meshtrain actually keeps; the tests hold the two to
the same arithmetic where they should agree)."""
from __future__ import annotations


def playbook_state_bytes(n_params: float, zero_stage: int, n_d: int, *, param_bytes: float = 2,
                         grad_bytes: float = 2, optimizer_bytes: float = 12) -> dict[str, float]:
    """The ZeRO paper's/playbook's model-state memory: (2 + 2 + K)·Ψ with K = 12, divided by N_d per stage."""
    p, gr, o = param_bytes * n_params, grad_bytes * n_params, optimizer_bytes * n_params
    return {"params": p / n_d if zero_stage >= 3 else p, "grads": gr / n_d if zero_stage >= 2 else gr,
            "optimizer": o / n_d if zero_stage >= 1 else o}


def gpt_layer_activation_bytes(s: int, b: int, h: int, a: int, *, t: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    """Korthikanti et al. (the playbook's activation formula) for one GPT layer in 16-bit:
    sbh(34 + 5as/h); with tp: sbh(10 + 24/t + 5as/(ht)); with tp+SP: sbh/t (34 + 5as/h);
    selective recomputation drops the 5as/h term; full recomputation keeps 2sbh (the layer input)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attn = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + attn)
    return s * b * h * (10 + 24 / t + attn / t)
