"""Light fine-tuning of a converted model: low-rank adapters on the attention projections, trained on next-token
prediction or by distillation from the exact teacher's logits (stage 2 of a linearisation, after the attention
transfer of the maps, :func:`kernapprox.trainable.fit_to_softmax`).

:class:`LoRALinear` (Hu et al. 2022, *LoRA: Low-Rank Adaptation of Large Language Models*, ICLR, eq. 3)
    ``y = W x + b + (α / r) B A x`` with the pretrained ``W, b`` frozen, ``A (r × in)`` drawn from
    ``N(0, 1 / in)`` and ``B (out × r) = 0``, so the adapted model starts as the model itself (§4.1: "random Gaussian
    initialization for A and zero for B").
:func:`~kernapprox.surgery.finetuning.add_lora`
    Wraps the chosen projections (default ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` of every attention module, as
    LoLCATs adapts them: Zhang et al. 2025, *LoLCATs*, §3.2) and freezes every other parameter; the trainable maps of
    a converted model's layers (:class:`~kernapprox.surgery.attention.TrainableAttention`) stay trainable with
    ``train_maps=True``.
:func:`finetune`
    AdamW on the trainable parameters, windows drawn without replacement from a seeded permutation; the objective
    is ``"next_token"`` (the mean cross-entropy of ``x_{t+1}`` given ``x_≤t``) or ``"distill"``: the mean over positions
    of ``T² · KL(softmax(z_teacher / T) ‖ softmax(z_student / T))`` (Hinton, Vinyals & Dean 2015, *Distilling the
    Knowledge in a Neural Network*, §2: the soft targets at temperature ``T``, the ``T²`` keeping the gradients'
    scale across ``T``). Both see the same tokens for the same ``steps`` and ``batch_size``: a comparison at equal
    token budget. For an encoder without a language-model head, ``"embedding"``: the mean over windows of
    ``‖e_student − e_teacher‖²`` between sentence embeddings (:func:`kernapprox.real.sentence_embedding`, mean
    pooling to unit length), the MSE distillation of Reimers & Gurevych 2020 (*Making Monolingual Sentence
    Embeddings Multilingual using Knowledge Distillation*, EMNLP, eq. 1). :class:`FinetuneRecord` holds the losses,
    the tokens and the cost.

The project's own LoRA, not the ``peft`` package: it needs nothing beyond torch, wraps the modules a converted copy
already has (peft would wrap the model and hide the attention modules :mod:`kernapprox.surgery` reaches by
name), and puts the adapters and a converted model's trainable maps in one optimiser.

>>> import torch, transformers
>>> from kernapprox.surgery.finetuning import add_lora, finetune
>>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
...                                   num_attention_heads=2, num_key_value_heads=1, attn_implementation="eager")
>>> with torch.random.fork_rng():   # transformers draws its initial weights from torch's global stream: the
...     model = transformers.LlamaForCausalLM(config).eval()      # caller's stream is left as it was; no output
...                                                                # below depends on those weights
>>> ids = torch.randint(0, 40, (4, 12), generator=torch.Generator().manual_seed(1))
>>> before = model(input_ids=ids).logits
>>> names = add_lora(model, rank=2, rng=0)
>>> len(names), bool(torch.equal(model(input_ids=ids).logits, before))          # B = 0: the model unchanged
(8, True)
>>> record = finetune(model, ids, steps=3, batch_size=2, lr=1e-2, rng=0)
>>> record.steps, record.tokens, len(record.losses)
(3, 66, 3)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..validation import check_choice, check_positive_float, check_positive_int
from .attention import TrainableAttention, get_attention
from .conversion import stack_for

__all__ = ["LoRALinear", "add_lora", "lora_parameters", "merge_lora", "finetune", "FinetuneRecord", "OBJECTIVES",
           "distillation_loss"]

OBJECTIVES = ("next_token", "distill", "embedding")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRALinear(torch.nn.Module):
    r"""A frozen ``torch.nn.Linear`` plus a trainable low-rank update (Hu et al. 2022, eq. 3):

    .. math::
        y = W x + b + \frac{α}{r} B A x, \qquad A ∈ ℝ^{r × d_{in}} \sim N(0, 1/d_{in}),\; B = 0 ∈ ℝ^{d_{out} × r}.

    Parameters
    ----------
    base : torch.nn.Linear
        The pretrained projection (kept, frozen: ``requires_grad=False``).
    rank : int
        ``r``.
    alpha : float
        ``α``; the update is scaled by ``α / r``.
    generator : torch.Generator, optional
        Draws ``A`` (on the CPU, then moved to ``base``'s device and dtype).
    """

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float = 16.0, *,
                 generator: torch.Generator | None = None):
        super().__init__()
        if not isinstance(base, torch.nn.Linear):
            raise TypeError(f"base must be a torch.nn.Linear, got {type(base).__name__}")
        rank = check_positive_int(rank, "rank")
        alpha = check_positive_float(alpha, "alpha")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        weight = base.weight
        a = torch.randn(rank, base.in_features, generator=generator, dtype=torch.float64) / math.sqrt(base.in_features)
        self.lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank, device=weight.device,
                                                     dtype=weight.dtype))

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The frozen pretrained weight (what code reading ``module.weight`` of a projection expects)."""
        return self.base.weight

    def delta_weight(self) -> torch.Tensor:
        """``(α / r) B A`` ``(out, in)``: what :func:`merge_lora` adds to ``W``."""
        return self.scaling * (self.lora_b @ self.lora_a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``W x + b + (α / r) B (A x)`` of ``x`` ``(..., in)``: ``(..., out)``."""
        return self.base(x) + self.scaling * torch.nn.functional.linear(
            torch.nn.functional.linear(x, self.lora_a), self.lora_b)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha:g}"


def add_lora(model, *, rank: int = 8, alpha: float = 16.0, targets: Sequence[str] = DEFAULT_TARGETS, layers=None,
             rng: int = 0, train_maps: bool = True) -> list[str]:
    """Wrap the projections ``targets`` of the attention modules of ``layers`` (default all) of ``model`` (a model
    :func:`~kernapprox.surgery.conversion.stack_for` adapts, converted or not) in :class:`LoRALinear`, in place, and
    freeze every other parameter of the model except, with ``train_maps``, the trainable maps of its converted
    layers.

    The adapters of layer ``l`` and projection ``name`` draw ``A`` from ``torch.Generator().manual_seed(seed)`` with
    ``seed`` from ``numpy.random.SeedSequence([rng, l, index of name])``, so a model's adapters are reproducible
    whatever other layers are adapted. Returns the qualified names of the wrapped projections; ``ValueError`` for a
    target that is not a ``torch.nn.Linear`` of the attention module (the message lists the ones it has) or for a
    model that is already adapted.
    """
    if isinstance(rng, bool) or not isinstance(rng, int) or rng < 0:
        raise ValueError(f"rng must be a non-negative int, got {rng!r}")
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) for t in targets):
        raise TypeError(f"targets must be a non-empty sequence of attribute names, got {targets!r}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters (merge_lora them first, or adapt a fresh copy)")
    stack = stack_for(model)
    chosen = range(stack.num_layers) if layers is None else list(layers)
    for layer in chosen:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < stack.num_layers:
            raise ValueError(f"layers must hold layer indices in [0, {stack.num_layers}), got {layer!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    names = {id(m): n for n, m in model.named_modules()}
    wrapped = []
    for layer in chosen:
        module = stack.attention_module(layer)
        for index, target in enumerate(targets):
            base = getattr(module, target, None)
            if not isinstance(base, torch.nn.Linear):
                linear = sorted(n for n, m in module.named_children() if isinstance(m, torch.nn.Linear))
                raise ValueError(f"target {target!r} is not a torch.nn.Linear of layer {layer}'s attention module "
                                 f"({type(module).__name__}); its projections: {', '.join(linear) or 'none'}")
            seed = int(np.random.SeedSequence([rng, layer, index]).generate_state(1)[0])
            setattr(module, target, LoRALinear(base, rank, alpha, generator=torch.Generator().manual_seed(seed)))
            wrapped.append(f"{names[id(module)]}.{target}")
        attention = get_attention(module)
        if train_maps and isinstance(attention, TrainableAttention):
            for p in attention.parameters():
                p.requires_grad_(True)
    return wrapped


def lora_parameters(model) -> list[torch.nn.Parameter]:
    """The ``A`` and ``B`` of every :class:`LoRALinear` of ``model``."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_a, m.lora_b)]


@torch.no_grad()
def merge_lora(model) -> int:
    """Fold every adapter into its projection (``W ← W + (α/r) B A``) and put the plain ``torch.nn.Linear`` back;
    returns how many were merged. The merged model computes what the adapted one did (to rounding)."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                child.base.weight += child.delta_weight().to(child.base.weight.dtype)
                setattr(module, name, child.base)
                count += 1
    return count


@dataclasses.dataclass(frozen=True)
class FinetuneRecord:
    """What :func:`finetune` did.

    Attributes
    ----------
    objective : str
        ``"next_token"`` or ``"distill"``.
    temperature : float
        ``T`` of the distillation (1 for next-token).
    losses : tuple of float
        Each step's batch loss, before that step's update.
    steps, batch_size : int
    tokens : int
        Positions trained on: ``steps · batch_size · (L − 1)`` (``L`` for ``"embedding"``: every token of a window).
    trainable_parameters : int
        Numbers the optimiser updated.
    lr : float
    cpu_seconds, wall_seconds : float
        Process CPU time (every thread) and wall time.
    """

    objective: str
    temperature: float
    losses: tuple
    steps: int
    batch_size: int
    tokens: int
    trainable_parameters: int
    lr: float
    cpu_seconds: float
    wall_seconds: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    r"""``T² · mean over positions of KL(p_T ‖ q_T)`` with ``p_T = softmax(z_teacher / T)``, ``q_T =
    softmax(z_student / T)`` over the last axis, computed in float32 or wider (Hinton et al. 2015, §2)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits {tuple(student_logits.shape)} and teacher_logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_q = torch.log_softmax(student_logits.to(dtype) / temperature, -1)
    log_p = torch.log_softmax(teacher_logits.to(dtype) / temperature, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return temperature ** 2 * kl.mean()


def _check_ids(input_ids) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                   torch.int32):
        raise TypeError(f"input_ids must be an integer tensor (windows, length), got "
                        f"{type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[1] < 2 or input_ids.shape[0] < 1:
        raise ValueError(f"input_ids must hold at least one window of 2 tokens or more, got {tuple(input_ids.shape)}")
    return input_ids


def finetune(model, input_ids: torch.Tensor, *, objective: str = "next_token", teacher=None,
             temperature: float = 2.0, steps: int = 100, batch_size: int = 4, lr: float = 1e-3,
             weight_decay: float = 0.0, rng: int = 0,
             on_step: Callable[[int, torch.nn.Module], None] | None = None) -> FinetuneRecord:
    """Train the parameters of ``model`` that require gradients (after
    :func:`~kernapprox.surgery.finetuning.add_lora`: the adapters, and the trainable maps) on the windows ``input_ids``
    ``(N, L)``.

    Parameters
    ----------
    objective : {"next_token", "distill", "embedding"}
        The loss (see the module docstring). ``"distill"`` needs ``teacher``, a model with the same vocabulary
        (e.g. the unconverted original), run without gradients on the same windows; ``"embedding"`` a teacher
        encoder whose ``last_hidden_state`` has the student's width (the model is then an encoder: its
        ``last_hidden_state`` is read, no cache argument is passed).
    temperature : float
        ``T`` of ``"distill"``.
    steps, batch_size : int
        ``steps`` AdamW updates, each on ``batch_size`` windows (``min(batch_size, N)``) taken in the order of
        seeded permutations of the ``N`` windows (``torch.Generator().manual_seed(rng)``): every window once before
        any twice.
    lr, weight_decay : float
        AdamW's (Loshchilov & Hutter 2019).
    on_step : callable, optional
        ``on_step(step, model)`` after each update (``step`` from 1): how a study evaluates along the budget.

    The model's training/evaluation mode is left as it is (a converted model refuses attention dropout in
    training). Returns a :class:`FinetuneRecord`; ``ValueError`` for a non-finite loss, naming the step.
    """
    objective = check_choice(objective, "objective", OBJECTIVES)
    if objective in ("distill", "embedding") and teacher is None:
        raise ValueError(f"objective={objective!r} needs the teacher model (teacher=)")
    temperature = check_positive_float(temperature, "temperature")
    steps = check_positive_int(steps, "steps")
    batch_size = check_positive_int(batch_size, "batch_size")
    lr = check_positive_float(lr, "lr")
    weight_decay = check_positive_float(weight_decay, "weight_decay", allow_zero=True)
    if isinstance(rng, bool) or not isinstance(rng, int) or rng < 0:
        raise ValueError(f"rng must be a non-negative int, got {rng!r}")
    input_ids = _check_ids(input_ids)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameter that requires gradients (add_lora first)")
    device = next(model.parameters()).device
    optimiser = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(rng)
    n = input_ids.shape[0]
    batch = min(batch_size, n)
    order: list[int] = []
    losses = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for step in range(1, steps + 1):
        while len(order) < batch:
            order += torch.randperm(n, generator=generator).tolist()
        picked, order = order[:batch], order[batch:]
        ids = input_ids[picked].to(device)
        if objective == "embedding":
            from ..real import sentence_embedding

            mine = sentence_embedding(model(input_ids=ids).last_hidden_state.float())
            with torch.no_grad():
                target = sentence_embedding(teacher(input_ids=ids).last_hidden_state.float())
            loss = (mine - target).pow(2).sum(-1).mean()
        else:
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
            if objective == "next_token":
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                         ids[:, 1:].reshape(-1))
            else:
                with torch.no_grad():
                    target = teacher(input_ids=ids, use_cache=False).logits[:, :-1]
                loss = distillation_loss(logits, target, float(temperature))
        if not torch.isfinite(loss):
            raise ValueError(f"the {objective} loss is not finite at step {step} (lower lr, or check the model's "
                             "logits)")
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, model)
    positions = input_ids.shape[1] - (objective != "embedding")      # an embedding reads every token of a window
    return FinetuneRecord(objective, float(temperature) if objective == "distill" else 1.0, tuple(losses), steps,
                          batch, steps * batch * positions, sum(p.numel() for p in params), float(lr),
                          time.process_time() - cpu0, time.perf_counter() - wall0)
