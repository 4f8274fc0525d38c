"""Helpers shared by the model tests (imported by file name: tests/models is on sys.path under pytest)."""

import copy

import torch

from verl.models.tiny import tiny_vocab
from verl.models.transformers.monkey_patch import apply_monkey_patch

VOCAB = tiny_vocab()
IMAGE_PAD = VOCAB["<|image_pad|>"]


def patched_copy(model, **kwargs):
    clone = copy.deepcopy(model)
    apply_monkey_patch(clone, **kwargs)
    return clone


def random_ids(n, generator):
    # Avoid special tokens so no placeholder logic is triggered in text-only tests.
    return torch.randint(30, 120, (1, n), generator=generator)


def token_log_probs(logits, ids):
    """log p(ids[t+1] | <= t) for t < L-1, per sequence (B, L-1)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


def make_image_sample(n_before, grid, n_after, generator, merge=2, patch_dim=96):
    t, h, w = grid
    n_img = t * h * w // (merge * merge)
    ids = torch.cat(
        [
            torch.randint(30, 120, (n_before,), generator=generator),
            torch.tensor([VOCAB["<|vision_start|>"]]),
            torch.full((n_img,), IMAGE_PAD),
            torch.tensor([VOCAB["<|vision_end|>"]]),
            torch.randint(30, 120, (n_after,), generator=generator),
        ]
    )[None]
    pixels = torch.randn(t * h * w, patch_dim, generator=generator)
    return dict(
        input_ids=ids,
        mm_token_type_ids=(ids == IMAGE_PAD).int(),
        pixel_values=pixels,
        image_grid_thw=torch.tensor([grid]),
    )
