"""Stage 2 of a linearisation (:mod:`kernapprox.surgery.finetuning`): LoRA adapters start at the model itself, merge to
the same function, train only what they should; the distillation loss is T²·KL of the tempered distributions; the
fine-tuning is seeded, sees the token budget it reports, and lowers its objective on small random Llamas."""

from __future__ import annotations

import pytest
import torch
import transformers

import kernapprox as ka
from kernapprox.surgery import attention as sa
from kernapprox.surgery.finetuning import LoRALinear, add_lora, distillation_loss, finetune, lora_parameters, merge_lora

VOCAB = 40


def llama(seed=0, dtype=torch.float64):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def windows(n=6, length=16, seed=1):
    # a repeating pattern with noise: learnable in a few steps
    gen = torch.Generator().manual_seed(seed)
    base = torch.arange(length) % 7 + 3
    ids = base.repeat(n, 1)
    noise = torch.rand(n, length, generator=gen) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, (n, length), generator=gen), ids)


def test_adapters_start_at_the_model_and_only_they_train():
    model = llama()
    ids = windows()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    names = add_lora(model, rank=3, alpha=6.0, rng=0)
    assert names == [f"model.layers.{layer}.self_attn.{p}" for layer in range(2)
                     for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)                  # B = 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(model)} and len(trainable) == 16
    module = model.model.layers[0].self_attn.q_proj
    assert isinstance(module, LoRALinear) and module.lora_a.shape == (3, 16) and module.scaling == 2.0
    # reproducible per (rng, layer, projection), whatever else is adapted
    other = llama()
    add_lora(other, rank=3, alpha=6.0, rng=0, layers=[0])
    assert torch.equal(other.model.layers[0].self_attn.q_proj.lora_a, module.lora_a)
    with pytest.raises(ValueError, match="already"):
        add_lora(model)
    with pytest.raises(ValueError, match="projections: .*q_proj"):
        add_lora(llama(), targets=("query",))
    with pytest.raises(ValueError, match="layers"):
        add_lora(llama(), layers=[2])


def test_merged_adapters_compute_what_the_adapted_model_did():
    model = llama()
    ids = windows()
    add_lora(model, rank=2, rng=1)
    for p in lora_parameters(model):                     # a non-trivial update
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        assert merge_lora(model) == 8
        merged = model(input_ids=ids).logits
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert float((merged - adapted).abs().max()) < 1e-10 * float(adapted.abs().max())


def test_distillation_loss_is_t_squared_kl_of_the_tempered_distributions():
    gen = torch.Generator().manual_seed(0)
    s, t = (torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) for _ in range(2))
    for temp in (1.0, 2.0, 4.0):
        p, q = torch.softmax(t / temp, -1), torch.softmax(s / temp, -1)
        want = temp ** 2 * (p * (p.log() - q.log())).sum(-1).mean()
        torch.testing.assert_close(distillation_loss(s, t, temp), want, rtol=1e-12, atol=0)
    assert float(distillation_loss(t, t, 2.0)) == pytest.approx(0.0, abs=1e-15)
    # the gradient at T: (q_T − p_T) · T / (positions) per logit (Hinton et al. 2015, eq. 2, times T²)
    s.requires_grad_(True)
    distillation_loss(s, t, 2.0).backward()
    want = 2.0 * (torch.softmax(s.detach() / 2, -1) - torch.softmax(t / 2, -1)) / 15
    torch.testing.assert_close(s.grad, want, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="shape"):
        distillation_loss(s, t[:, :3])


def _objective(model, ids, objective, teacher):
    """The objective on every window at once (no update)."""
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        if objective == "next_token":
            return float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)))
        return float(distillation_loss(logits, teacher(input_ids=ids, use_cache=False).logits[:, :-1], 2.0))


@pytest.mark.parametrize("objective", ["next_token", "distill"])
def test_finetuning_is_seeded_counts_its_tokens_and_lowers_its_objective(objective):
    ids = windows(n=6, length=16)
    teacher = llama(seed=5)
    runs, ends = [], []
    for _ in range(2):
        student = ka.convert(llama(), "positive_orthogonal", num_features=16, rng=0, share_heads="group")
        add_lora(student, rank=4, rng=0)
        start = _objective(student, ids, objective, teacher)
        runs.append(finetune(student, ids, objective=objective, teacher=teacher, steps=40, batch_size=3, lr=2e-2,
                             rng=3))
        ends.append(_objective(student, ids, objective, teacher))
    a, b = runs
    assert a.losses == b.losses and ends[0] == ends[1]                       # seeded
    assert a.tokens == 40 * 3 * 15 and a.steps == 40 and a.batch_size == 3 and a.objective == objective
    assert a.trainable_parameters == sum(p.numel() for p in lora_parameters(student))
    # on every window: next-token CE starts near log(40) = 3.69 and the attention adapters alone move it slowly;
    # the teacher's KL falls by a factor
    if objective == "next_token":
        assert ends[0] < start - 0.1
    else:
        assert ends[0] < 0.8 * start


def bert(seed=0):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=24, attn_implementation="eager", initializer_range=0.3)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return transformers.BertModel(config).double().eval()


def test_an_encoder_learns_its_teachers_sentence_embeddings():
    """Stage 2 of an encoder: adapters on BERT's query, key and value trained by the MSE of the pooled, unit-length
    embeddings (Reimers & Gurevych 2020) to a teacher's; seeded, every token counted, the objective falls."""
    ids = windows(n=6, length=12)
    teacher = bert(seed=0)

    def objective(model):
        with torch.no_grad():
            mine = ka.real.sentence_embedding(model(input_ids=ids).last_hidden_state)
            theirs = ka.real.sentence_embedding(teacher(input_ids=ids).last_hidden_state)
        return float((mine - theirs).pow(2).sum(-1).mean())

    runs, ends = [], []
    for _ in range(2):
        student = ka.convert(teacher, "positive_orthogonal", num_features=4, rng=0)   # far from the teacher
        add_lora(student, rank=4, targets=("query", "key", "value"), rng=0)
        start = objective(student)
        runs.append(finetune(student, ids, objective="embedding", teacher=teacher, steps=30, batch_size=3, lr=2e-2,
                             rng=1))
        ends.append(objective(student))
    assert runs[0].losses == runs[1].losses and runs[0].tokens == 30 * 3 * 12
    assert start > 0 and ends[0] < 0.5 * start, (start, ends[0])
    with pytest.raises(ValueError, match="teacher"):
        finetune(student, ids, objective="embedding")
    # the pooling: the mean over the real tokens, unit length
    hidden = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pooled = ka.real.sentence_embedding(hidden, mask)
    want = torch.nn.functional.normalize(hidden[0, :3].mean(0), dim=0)
    torch.testing.assert_close(pooled[0], want)
    torch.testing.assert_close(pooled.norm(dim=-1), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="without a token"):
        ka.real.sentence_embedding(hidden, torch.zeros(2, 5))


def test_trainable_maps_train_with_the_adapters():
    student = ka.convert(llama(), "hedgehog_trainable", num_features=16, rng=0)
    add_lora(student, rank=2, rng=0)
    maps = [p for layer in student.model.layers for p in sa.get_attention(layer.self_attn).parameters()]
    assert maps and all(p.requires_grad for p in maps)
    before = [p.detach().clone() for p in maps]
    finetune(student, windows(), steps=3, batch_size=2, lr=1e-2)
    assert any(not torch.equal(p, q) for p, q in zip(maps, before))
    frozen = ka.convert(llama(), "hedgehog_trainable", num_features=16, rng=0)
    add_lora(frozen, rank=2, rng=0, train_maps=False)
    assert not any(p.requires_grad for layer in frozen.model.layers
                   for p in sa.get_attention(layer.self_attn).parameters())


def test_bad_calls_are_refused():
    ids = windows()
    with pytest.raises(ValueError, match="no parameter"):
        finetune(llama().requires_grad_(False), ids)
    model = llama()
    add_lora(model, rng=0)
    with pytest.raises(ValueError, match="objective"):
        finetune(model, ids, objective="kl")
    with pytest.raises(ValueError, match="teacher"):
        finetune(model, ids, objective="distill")
    with pytest.raises(ValueError, match="temperature"):
        finetune(model, ids, objective="distill", teacher=llama(), temperature=0)
    with pytest.raises(TypeError, match="input_ids"):
        finetune(model, ids.float())
    with pytest.raises(ValueError, match="lr"):
        finetune(model, ids, lr=0.0)
