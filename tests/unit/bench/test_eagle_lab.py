"""The EAGLE lab (bench/eagle_head.py, bench/spec_sim.py, bench/draft_costs.py, bench.eagle_lab) on
tiny random models on the CPU: the training-time-test mask is what decoding sees, the simulated
speculative decoding keeps the target's output and distribution, the dense-cache rows are the
model's forward, and the lab runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torch

from bench import eagle_lab, train_models
from bench.draft_costs import Costs
from bench.eagle_head import EagleHead, load_head, save_head, ttt_mask
from bench.make_default_model import train_bpe
from bench.spec_sim import HeadDrafter, ModelDrafter, distribution, simulate, verify
from bench.train_llama import ModelShape, TrainLlama

VOCAB = 300
TARGET = ModelShape(32, 64, 2, 4, 2, 8)
DRAFT = ModelShape(16, 32, 1, 2, 1, 8)


def _models(seed: int = 0) -> tuple[TrainLlama, TrainLlama, EagleHead]:
    target = TrainLlama(TARGET, VOCAB, seed=seed).eval().requires_grad_(False)
    target.lm_head.weight.mul_(100.0)  # peaked distributions: a random draft then gets rejected at T=1
    draft = TrainLlama(DRAFT, VOCAB, seed=seed + 1).eval().requires_grad_(False)
    head = EagleHead(target, seed + 2).eval().requires_grad_(False)
    return target, draft, head


def test_ttt_mask_step_one_is_causal_and_later_steps_see_the_chain() -> None:
    seq = 6
    assert torch.equal(ttt_mask(seq, 1, torch.device("cpu")), torch.ones(seq, seq, dtype=torch.bool).tril())
    m = ttt_mask(seq, 3, torch.device("cpu"))  # [6, 18]: step 1's keys, step 2's, its own
    j = 4  # chain from c = 2: true keys 0..2, step 2's key at 3, its own at 4
    assert m[j, :seq].nonzero().flatten().tolist() == [0, 1, 2]
    assert m[j, seq : 2 * seq].nonzero().flatten().tolist() == [3]
    assert m[j, 2 * seq :].nonzero().flatten().tolist() == [4]


@torch.no_grad()
def test_unrolled_step_s_is_the_head_drafting_from_its_own_outputs() -> None:
    torch.manual_seed(0)
    target, _, head = _models()
    tokens = torch.randint(0, VOCAB, (1, 12))
    h = target.hidden(tokens)  # h_i for token i
    steps = 3
    outs = head.unrolled(tokens[:, 1:], h[:, :-1], steps)  # index j: (x_{j+1}, h_j)
    for s in range(1, steps + 1):
        for c in range(0, 11 - s + 1):  # the chain starts at index c with true features, drafts to j
            j = c + s - 1
            toks, feats = tokens[:, 1 : c + 2], h[:, : c + 1]
            for _ in range(s - 1):  # drafting: the token is the true next one (teacher forcing), f the head's
                f = head(toks, feats)[:, -1:]
                feats = torch.cat((feats, f), dim=1)
                toks = tokens[:, 1 : toks.shape[1] + 2]
            expected = head(toks, feats)[0, -1]
            torch.testing.assert_close(outs[s - 1][0, j], expected, atol=1e-5, rtol=1e-5)


def test_verify_draws_from_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    counts = torch.zeros(4)
    trials = 6000
    for _ in range(trials):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        kept, after = verify(p, [d], q, 1.0, gen)
        counts[d if kept else after] += 1
    assert torch.allclose(counts / trials, p[0], atol=0.02), counts / trials


@torch.no_grad()
def test_simulation_keeps_greedy_output_and_accepts_the_target_as_its_own_draft() -> None:
    target, draft, head = _models()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    greedy = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(7):
            seq.append(int(target(torch.tensor([seq]))[0, -1].argmax()))
        greedy.append(seq[len(prompt) :])
    for drafter in (ModelDrafter(draft), HeadDrafter(head, target)):
        counts, outs = simulate(target, drafter, prompts, 3, 0.0, 7, seed=0)
        assert outs == greedy
        assert counts.num_drafted == 3 * counts.num_verifications
    counts, _ = simulate(target, ModelDrafter(target), prompts, 3, 1.0, 7, seed=0)
    summary = counts.summary()
    assert summary["a_per_tested_draft"] == 1.0 and summary["tokens_per_verification"] == 4.0
    counts, _ = simulate(target, ModelDrafter(draft), prompts, 3, 1.0, 7, seed=0)
    assert counts.summary()["a_per_tested_draft"] < 1.0


@torch.no_grad()
def test_dense_cache_rows_are_the_forward() -> None:
    target, draft, head = _models()
    costs = Costs(target, draft, head, k=2, context=12)
    tokens = torch.randint(0, VOCAB, (1, 9))
    cache = costs.caches["target"]
    rows = costs._model_rows(target, cache, tokens[:, :6], 0)
    for i in range(6, 9):  # then one row at a time, as decoding feeds them
        rows = torch.cat((rows, costs._model_rows(target, cache, tokens[:, i : i + 1], i)), dim=1)
    torch.testing.assert_close(rows, target.hidden(tokens), atol=1e-5, rtol=1e-5)
    assert distribution(torch.tensor([1.0, 3.0, 2.0]), 0.0).tolist() == [0.0, 1.0, 0.0]


@torch.no_grad()
def test_saved_head_loads_with_llama_names_and_refuses_another_target(tmp_path: Path) -> None:
    target, _, head = _models()
    save_head(tmp_path / "head", head, unroll=3)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert (config["hidden_size"], config["vocab_size"]) == (32, VOCAB)
    assert config["eagle"] == {"version": 1, "training_unroll": 3, "target_num_hidden_layers": 2}
    loaded = load_head(tmp_path / "head", target)
    assert "layers.0.self_attn.q_proj.weight" in loaded.state_dict() and "fc.weight" in loaded.state_dict()
    tokens, feats = torch.randint(0, VOCAB, (1, 7)), torch.randn(1, 7, 32)
    torch.testing.assert_close(loaded(tokens, feats), head(tokens, feats), atol=0, rtol=0)
    other = TrainLlama(ModelShape(32, 64, 3, 4, 2, 8), VOCAB, seed=0)
    with pytest.raises(ValueError, match="target_num_hidden_layers is 2, the target's is 3"):
        load_head(tmp_path / "head", other)


def _tiny_pair(out: Path) -> None:
    texts, held = train_models.split_corpus(max_train_bytes=60_000, max_held_out_bytes=20_000)
    tokenizer = train_bpe(texts, VOCAB)
    target, draft, _ = _models()
    assert tokenizer.get_vocab_size() == VOCAB
    train_models.save_checkpoint(out / "target", target, tokenizer)
    train_models.save_checkpoint(out / "draft", draft, tokenizer)
    (out / "held_out.txt").write_text("\n".join(held))


def test_lab_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    _tiny_pair(tmp_path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        record = eagle_lab.main([
            "--pair", str(tmp_path), "--size", "cpu-tiny", "--head-seconds", "20", "--head-steps", "3",
            "--batch-size", "2", "--num-prompts", "2", "--prompt-len", "12", "--max-tokens", "6",
            "--eval-windows", "2", "--device", "cpu", "--out", str(tmp_path / "out"),
            "--save-head", str(tmp_path / "head"),
        ])
        again = eagle_lab.main([
            "--pair", str(tmp_path), "--size", "cpu-tiny", "--head", str(tmp_path / "head"), "--num-prompts", "2",
            "--prompt-len", "12", "--max-tokens", "6", "--eval-windows", "2", "--device", "cpu",
            "--out", str(tmp_path / "again"),
        ])
    finally:
        torch.set_num_threads(threads)
    assert record["head_training"]["num_steps"] == 3
    assert (tmp_path / "head" / "model.safetensors").is_file()
    assert record["greedy_outputs_equal"] is True
    saved = json.loads((tmp_path / "out" / "eagle_lab_pair88m_cpu.json").read_text())
    assert saved["simulated"].keys() == {"draft_model_t0", "head_t0", "draft_model_t1", "head_t1"}
    for figures in saved["simulated"].values():
        assert 1.0 <= figures["tokens_per_verification"] <= 5.0
    # the saved head measured again: no training, the same held-out figures
    assert again["head_training"] == {"loaded_from": str(tmp_path / "head")}
    assert again["teacher_forced_acceptance_t1"] == pytest.approx(record["teacher_forced_acceptance_t1"])
    steps = saved["teacher_forced_acceptance_t1"]["head_by_step"]
    assert len(steps) == 4 and all(0.0 < a <= 1.0 for a in steps)


def test_projection_is_tokens_per_verification_times_plain_over_the_speculative_step() -> None:
    sim = {f"{d}_t{t}": {"tokens_per_verification": v} for d, v in (("draft_model", 3.0), ("head", 4.0))
           for t in ("0", "1")}
    costs = {"plain_step": 1.0, "verification": 1.5, "draft_model_loop": 1.5, "head_loop": 0.5}
    got = eagle_lab.projection(sim, costs)
    assert got["draft_model_t0"] == 1.0 and got["head_t1"] == 2.0
