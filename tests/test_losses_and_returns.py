"""Masking, log-probs, advantages and returns pinned on small hand-built cases."""

from __future__ import annotations

import math

import pytest
import torch

from comlrl.losses import completion_mask, group_advantages, policy_gradient_loss, shared_prompt_token_logprobs
from comlrl.models import load_causal_lm
from comlrl.rollout import TurnBatch, completion_returns, compute_returns, joint_action_indices

EOS = 256


def test_mask_trains_eos_and_last_token_and_drops_padding_after_eos():
    ids = torch.tensor([
        [10, 11, EOS, EOS, EOS],   # EOS mid-sequence, padded with the EOS id (pad == eos)
        [10, 11, 12, 13, 14],      # ran to max_new_tokens: every token, the last one too
        [EOS, EOS, EOS, EOS, EOS],  # stopped at once: only the EOS itself
        [10, 11, 12, 13, EOS],     # EOS as the very last token
    ])
    expected = torch.tensor([
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(completion_mask(ids, [EOS]), expected)


def test_mask_with_separate_pad_and_several_eos_ids():
    ids = torch.tensor([[5, 7, 9, 1, 1], [5, 8, 2, 3, 3]])  # eos ids {7, 8}; pad 1 after it
    assert torch.equal(completion_mask(ids, [7, 8]).int(), torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]]))


def test_padded_batch_logprobs_match_each_sequence_alone(tiny_model_dir):
    """One left-padded forward gives each trained token's log-prob as an unpadded forward does,
    and the masked sum is exactly the sum over the trained tokens."""
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir).eval()
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8, 9])]
    completions = torch.tensor([[20, 21, EOS, EOS], [30, 31, 32, 33]])
    mask = completion_mask(completions, [EOS])
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((2, width), EOS)
    prompt_mask = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p):] = p
        prompt_mask[i, width - len(p):] = 1
    with torch.no_grad():
        batched = shared_prompt_token_logprobs(model, prompt_ids, prompt_mask, completions, mask, group_size=1)
        for i, p in enumerate(prompts):
            n = int(mask[i].sum())
            full = torch.cat([p, completions[i, :n]]).unsqueeze(0)
            logits = model(input_ids=full).logits[0, len(p) - 1:-1].float()
            alone = logits.log_softmax(-1).gather(-1, completions[i, :n].unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(batched[i, :n], alone, atol=1e-5)
            assert torch.allclose((batched[i] * mask[i]).sum(), alone.sum(), atol=1e-5)


def test_policy_gradient_loss_types():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])
    # sums: -3 and -1 -> -(( -3*2) + (-1*-1))/2 = -(-6 + 1)/2 = 2.5
    assert policy_gradient_loss(logp, mask, adv, "sum").item() == pytest.approx(2.5)
    # seq means: -1.5, -1/3 -> -((-1.5*2) + (1/3))/2
    assert policy_gradient_loss(logp, mask, adv, "seq_mean").item() == pytest.approx(-((-3.0) + 1 / 3) / 2)
    # tokens: (-1*2 + -2*2 + -0.5*-1 + -0.5*-1 + 0) / 5 trained tokens
    assert policy_gradient_loss(logp, mask, adv, "token_mean").item() == pytest.approx(-(-6.0 + 1.0) / 5)
    with pytest.raises(ValueError, match="loss_type"):
        policy_gradient_loss(logp, mask, adv, "mean")


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    assert torch.allclose(group_advantages(r, "mean", False), torch.tensor([[-2.0, -1.0, 0.0, 3.0]]))
    assert torch.allclose(group_advantages(r, "raw", False), r)
    assert torch.allclose(group_advantages(r, "max", False), torch.tensor([[-5.0, -4.0, -3.0, 0.0]]))
    # rloo: r_i - mean(others): 1-11/3, 2-10/3, 3-3, 6-2
    assert torch.allclose(group_advantages(r, "rloo", False), torch.tensor([[1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0]]))
    normed = group_advantages(r, "mean", True)
    std = math.sqrt((4 + 1 + 0 + 9) / 4)
    assert torch.allclose(normed, torch.tensor([[-2.0, -1.0, 0.0, 3.0]]) / std)
    assert torch.equal(group_advantages(torch.ones(1, 4), "mean", True), torch.zeros(1, 4))


def _turn(turn, rewards, joint_index, parent):
    rewards = torch.tensor(rewards, dtype=torch.float64)
    return TurnBatch(turn, [{}] * rewards.shape[0], [], [], joint_index, rewards, parent)


def test_aligned_returns_single_turn():
    ji = joint_action_indices(2, 3, "aligned")
    assert ji.tolist() == [[0, 0], [1, 1], [2, 2]]
    t = _turn(0, [[0.1, 0.5, 0.9]], ji, [None])
    compute_returns([t], 1.0)
    assert torch.equal(completion_returns(t, 0, 3), torch.tensor([[0.1, 0.5, 0.9]], dtype=torch.float64))
    assert torch.equal(completion_returns(t, 1, 3), torch.tensor([[0.1, 0.5, 0.9]], dtype=torch.float64))


def test_cross_returns_are_means_over_the_joint_actions_a_completion_is_in():
    ji = joint_action_indices(2, 2, "cross")
    assert ji.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    t = _turn(0, [[1.0, 2.0, 3.0, 5.0]], ji, [None])
    compute_returns([t], 1.0)
    # agent 0: sample 0 in (0,0),(0,1) -> 1.5; sample 1 in (1,0),(1,1) -> 4
    assert completion_returns(t, 0, 2).tolist() == [[1.5, 4.0]]
    # agent 1: sample 0 in (0,0),(1,0) -> 2; sample 1 in (0,1),(1,1) -> 3.5
    assert completion_returns(t, 1, 2).tolist() == [[2.0, 3.5]]
    assert joint_action_indices(3, 2, "cross").shape == (8, 3)


@pytest.mark.parametrize("discount", [0.5, 1.0])
def test_two_turn_returns_apply_the_discount(discount):
    ji = joint_action_indices(2, 2, "aligned")
    root = _turn(0, [[1.0, 0.0]], ji, [None])
    # each joint action of the root spawned one child node with 2 joint actions
    child = _turn(1, [[0.2, 0.4], [1.0, 3.0]], ji, [(0, 0), (0, 1)])
    compute_returns([root, child], discount)
    assert child.returns.tolist() == [[0.2, 0.4], [1.0, 3.0]]
    assert root.returns.tolist() == [[1.0 + discount * 0.3, 0.0 + discount * 2.0]]


def test_shared_prompt_logprobs_and_gradients_match_k_separate_copies(tiny_model_dir):
    """One prompt forward shared by its K completions computes the same log-probs and gradients as
    the prompt repeated K times (left padding included)."""
    model = load_causal_lm(tiny_model_dir)
    torch.manual_seed(1)
    k = 3
    prompt_ids = torch.randint(0, 256, (2, 6))
    prompt_mask = torch.ones(2, 6, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completions = torch.randint(0, 256, (2 * k, 9))
    completions[1, 4] = EOS
    mask = completion_mask(completions, [EOS])
    shared = shared_prompt_token_logprobs(model, prompt_ids, prompt_mask, completions, mask, group_size=k)
    copies = shared_prompt_token_logprobs(model, prompt_ids.repeat_interleave(k, 0), prompt_mask.repeat_interleave(k, 0),
                                          completions, mask, group_size=1)
    assert torch.allclose(shared * mask, copies * mask, atol=1e-5)
    params = list(model.parameters())
    grads_shared = torch.autograd.grad((shared * mask).sum(), params)
    grads_copies = torch.autograd.grad((copies * mask).sum(), params)
    for a, b in zip(grads_shared, grads_copies):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
