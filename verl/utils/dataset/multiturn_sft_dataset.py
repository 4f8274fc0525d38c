"""Multi-turn chat conversations for supervised fine-tuning, with a loss mask on the assistant turns.

A row holds a list of chat messages (``data.messages_key``): ``system`` / ``user`` / ``assistant`` / ``tool``
turns, where an assistant turn may carry ``reasoning_content`` and ``tool_calls``. Optional columns: the
row's tool schemas (``data.tools_key``, given to the chat template), its ``enable_thinking`` flag
(``data.enable_thinking_key``, default ``data.enable_thinking_default``) and the images / videos that
``<image>`` / ``<video>`` placeholders in message texts refer to (``data.image_key`` / ``data.video_key``);
image and video parts may also sit directly in a message's content list.

How a row becomes tokens. The conversation is cut into *segments*: everything before the first assistant
turn, then each assistant turn, then each run of non-assistant turns between them. Each segment is rendered
on its own (after a placeholder user turn whose text is then removed, so the template sees a valid chat),
tokenised, and the pieces are concatenated. An assistant segment is split further into its header (the
text the template's generation prompt also produces, e.g. ``<|im_start|>assistant\\n``), its body up to and
including the end-of-turn token, and the trailing newline; only the body is in the loss. The whole
conversation is also rendered and tokenised in one go: the two must agree, or the row is reported (a
template that rewrites earlier turns - e.g. strips old reasoning - or a tokeniser merge across a boundary);
``data.ignore_input_ids_mismatch=true`` keeps the turn-by-turn ids instead.

``loss_mask[t] = 1`` means token ``t`` is a training target (so the loss on the logits at ``t - 1``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from jinja2.exceptions import TemplateError
from torch.utils.data import Dataset

from verl.utils.chat_template import apply_chat_template
from verl.utils.config import cfg_get, to_plain
from verl.utils.dataset.rl_dataset import _read_data_file
from verl.utils.dataset.vision_utils import process_image, process_video

logger = logging.getLogger(__name__)

__all__ = ["MultiTurnSFTDataset", "SFTRowError", "sft_collate_fn", "PAD_MODES", "TRUNCATION_MODES"]

PAD_MODES = ("no_padding", "right")
TRUNCATION_MODES = ("error", "left", "right")
ROLES = ("system", "user", "assistant", "tool")
_PLACEHOLDER_RE = re.compile(r"(<image>|<video>)")
# A user turn that anchors each segment's rendering; its own text is removed again (it never reaches a row).
_ANCHOR = {"role": "user", "content": "VERLSFTANCHORTURN"}
_RESERVED_TEMPLATE_KWARGS = ("tokenize", "add_generation_prompt", "return_dict", "return_tensors", "tools")


class SFTRowError(ValueError):
    """A dataset row that cannot be trained on; the message names the row and what is wrong."""


@dataclass
class _Piece:
    text: str
    trained: bool
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)


def _none_free(value: Any) -> Any:
    """Drop ``None`` entries from dicts, recursively: parquet stores a list of structs with the union of all
    their keys, so a text part gains ``image: None`` and a plain turn ``tool_calls: None``; templates test
    ``is defined``, which a ``None`` passes."""
    if isinstance(value, dict):
        return {k: _none_free(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_none_free(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_none_free(v) for v in value.tolist()]
    return value


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class MultiTurnSFTDataset(Dataset):
    """Chat conversations from parquet / json / jsonl files, tokenised with an assistant-only loss mask.

    Args:
        parquet_files: one path or a list of paths.
        tokenizer: a Hugging Face tokenizer with a chat template.
        config: the ``data`` config section (see ``sft_trainer_engine.yaml``).
        processor: the model's multimodal processor; needed only for rows with images or videos.
        max_samples: keep the first ``max_samples`` rows (``-1``: all).
        model_config: the model's HF config (or directory) for mRoPE position ids; by default the config next
            to the tokenizer when a processor is given.
    """

    def __init__(self, parquet_files, tokenizer, config, processor=None, max_samples: int = -1, model_config=None):
        files = to_plain(parquet_files)
        files = [files] if isinstance(files, str | os.PathLike) else list(files or [])
        if not files:
            raise ValueError("MultiTurnSFTDataset: no data files given (data.train_files / data.val_files)")
        self.files = [os.path.expanduser(os.fspath(f)) for f in files]
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config
        self.max_samples = int(max_samples)

        self.messages_key = cfg_get(config, "messages_key", "messages")
        self.tools_key = cfg_get(config, "tools_key", "tools")
        self.enable_thinking_key = cfg_get(config, "enable_thinking_key", "enable_thinking")
        default = cfg_get(config, "enable_thinking_default", None)
        if isinstance(default, str):  # upstream's yaml spells "unset" as the string none
            if default.lower() not in ("none", "null", "true", "false"):
                raise ValueError(f"data.enable_thinking_default={default!r}; use true, false or null")
            default = {"true": True, "false": False}.get(default.lower())
        self.enable_thinking_default = default
        self.image_key = cfg_get(config, "image_key", "images")
        self.video_key = cfg_get(config, "video_key", "videos")
        self.pad_mode = cfg_get(config, "pad_mode", "no_padding")
        self.max_length = int(cfg_get(config, "max_length", 1024))
        self.truncation = cfg_get(config, "truncation", "error")
        self.ignore_input_ids_mismatch = bool(cfg_get(config, "ignore_input_ids_mismatch", False))
        self.template_kwargs = dict(to_plain(cfg_get(config, "apply_chat_template_kwargs", {})) or {})
        if self.pad_mode not in PAD_MODES:
            raise ValueError(f"data.pad_mode={self.pad_mode!r} is not supported; use one of {PAD_MODES}")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r} is not supported; use one of {TRUNCATION_MODES}")
        if self.max_length <= 0:
            raise ValueError(f"data.max_length must be positive, got {self.max_length}")
        reserved = sorted(set(self.template_kwargs) & set(_RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise ValueError(f"data.apply_chat_template_kwargs may not set {reserved}; the dataset sets them per row")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("MultiTurnSFTDataset: the tokenizer has no chat template (set model.custom_chat_template)")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_token_id is None:
            raise ValueError("MultiTurnSFTDataset: the tokenizer has neither a pad nor an eos token")
        # The end-of-turn token closes every assistant turn the loss covers.
        self.eos_text = tokenizer.eos_token
        self._init_rope(model_config)
        self._read()

    # ------------------------------------------------------------------ setup
    def _init_rope(self, model_config) -> None:
        self.rope_indexer = None
        self._model_config = None
        self.image_token_id = self.video_token_id = None
        if model_config is None and self.processor is None:
            return
        if model_config is None or isinstance(model_config, str | os.PathLike):
            path = model_config if model_config is not None else getattr(self.tokenizer, "name_or_path", None)
            model_config = None
            if path and os.path.isfile(os.path.join(os.path.expanduser(os.fspath(path)), "config.json")):
                from transformers import AutoConfig

                model_config = AutoConfig.from_pretrained(os.path.expanduser(os.fspath(path)))
        if model_config is None:
            return
        from verl.utils.rope_index import rope_indexer_from_config

        self.rope_indexer = rope_indexer_from_config(model_config)
        if self.rope_indexer is not None:
            self._model_config = model_config
            self.image_token_id = getattr(model_config, "image_token_id", None)
            self.video_token_id = getattr(model_config, "video_token_id", None)

    def _read(self) -> None:
        rows, origins = [], []
        for path in self.files:
            file_rows = _read_data_file(path, who="MultiTurnSFTDataset")
            rows.extend(file_rows)
            origins.extend((path, i) for i in range(len(file_rows)))
        if 0 < self.max_samples < len(rows):
            rows, origins = rows[: self.max_samples], origins[: self.max_samples]
        self.rows, self._origins = rows, origins
        # Structure is checked for every row up front (cheap), so a malformed file fails before training starts;
        # rendering and tokenising happen per item.
        for i in range(len(rows)):
            self._messages(i, decode_media=False)
        logger.info("MultiTurnSFTDataset: %d conversations from %d file(s)", len(rows), len(self.files))

    def __getstate__(self):
        state = self.__dict__.copy()
        state["rope_indexer"] = None  # bound methods of the model class; rebuilt from the config
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self._model_config is not None:
            from verl.utils.rope_index import rope_indexer_from_config

            self.rope_indexer = rope_indexer_from_config(self._model_config)

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ row structure
    def _fail(self, index: int, what: str) -> SFTRowError:
        path, row = self._origins[index]
        return SFTRowError(f"MultiTurnSFTDataset: row {index} (row {row} of {path}): {what}")

    def _messages(self, index: int, decode_media: bool = True):
        """The row's messages (validated, placeholders made content parts), images, videos, tools, thinking.

        ``decode_media=False`` checks the structure only (media entries are counted, not decoded)."""
        row = self.rows[index]
        if self.messages_key not in row or row[self.messages_key] is None:
            raise self._fail(index, f"no messages under data.messages_key={self.messages_key!r}; the row has "
                                    f"columns {sorted(k for k, v in row.items() if v is not None)}")
        messages = _none_free(copy.deepcopy(to_plain(row[self.messages_key])))
        if not isinstance(messages, list) or not messages:
            raise self._fail(index, f"{self.messages_key!r} must be a non-empty list of messages, got "
                                    f"{type(messages).__name__}")
        for k, m in enumerate(messages):
            self._check_message(index, k, m)
        if not any(m["role"] == "assistant" for m in messages):
            raise self._fail(index, "the conversation has no assistant turn, so nothing would be trained")
        images = list(row.get(self.image_key)) if self._has(row, self.image_key) else []
        videos = list(row.get(self.video_key)) if self._has(row, self.video_key) else []
        messages, images, videos = self._place_media(index, messages, images, videos, decode_media)
        tools = self._tools(index, row)
        thinking = row.get(self.enable_thinking_key) if self.enable_thinking_key in row else None
        if thinking is None:
            thinking = self.enable_thinking_default
        elif not isinstance(thinking, bool | np.bool_):
            raise self._fail(index, f"{self.enable_thinking_key!r} must be true, false or null, got {thinking!r}")
        return messages, images, videos, tools, None if thinking is None else bool(thinking)

    @staticmethod
    def _has(row: dict, key: str) -> bool:
        value = row.get(key)
        return value is not None and len(value) > 0

    def _check_message(self, index: int, k: int, m: Any) -> None:
        if not isinstance(m, dict) or "role" not in m:
            raise self._fail(index, f"message {k} must be a dict with a 'role', got {str(m)[:80]!r}")
        role = m["role"]
        if role not in ROLES:
            raise self._fail(index, f"message {k} has role {role!r}; expected one of {ROLES}")
        if role == "system" and k != 0:
            raise self._fail(index, f"message {k} is a system message; only the first message may be one")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise self._fail(index, f"message {k} ({role}) content must be a string or a list of parts, got "
                                    f"{type(content).__name__}")
        if role != "assistant" and (m.get("tool_calls") or m.get("reasoning_content")):
            raise self._fail(index, f"message {k} is a {role} message with tool_calls/reasoning_content; only "
                                    "assistant messages carry those")
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise self._fail(index, f"message {k} tool call {j} has no function name: {str(call)[:120]!r}")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as err:
                    raise self._fail(index, f"message {k} tool call {j} ({fn['name']}) has arguments that are not "
                                            f"valid JSON ({err.msg} at position {err.pos}): {args[:120]!r}") from err
                fn["arguments"] = args
            if not isinstance(args, dict):
                raise self._fail(index, f"message {k} tool call {j} ({fn['name']}) arguments must be a JSON object, "
                                        f"got {type(args).__name__}")

    def _place_media(self, index: int, messages: list[dict], images: list, videos: list, decode: bool):
        """Turn ``<image>``/``<video>`` placeholders into content parts; collect all media in rendering order."""
        load_image = process_image if decode else (lambda x: x)
        load_video = process_video if decode else (lambda x: x)
        counts = {"<image>": 0, "<video>": 0}
        ordered_images, ordered_videos = [], []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and (images or videos) and _PLACEHOLDER_RE.search(content):
                parts = []
                for piece in _PLACEHOLDER_RE.split(content):
                    if piece in counts:
                        pool = images if piece == "<image>" else videos
                        if counts[piece] >= len(pool):
                            raise self._fail(index, f"more {piece} placeholders than entries in "
                                                    f"{self.image_key if piece == '<image>' else self.video_key!r}")
                        kind = piece[1:-1]
                        parts.append({"type": kind, kind: pool[counts[piece]]})
                        counts[piece] += 1
                    elif piece:
                        parts.append({"type": "text", "text": piece})
                m["content"] = content = parts
            if isinstance(content, list):
                for p, part in enumerate(content):
                    if not isinstance(part, dict):
                        raise self._fail(index, f"a content part must be a dict, got {str(part)[:80]!r}")
                    kind = part.get("type")
                    if kind == "image" or "image" in part or "image_url" in part:
                        ordered_images.append(load_image(part.get("image", part.get("image_url"))))
                    elif kind == "video" or "video" in part:
                        ordered_videos.append(load_video(part.get("video")))
        if counts["<image>"] != len(images) or counts["<video>"] != len(videos):
            raise self._fail(index, f"{counts['<image>']} <image> and {counts['<video>']} <video> placeholders but "
                                    f"{len(images)} images and {len(videos)} videos; they must match one to one")
        if (ordered_images or ordered_videos) and self.processor is None:
            raise self._fail(index, "the conversation has images/videos but the model has no processor "
                                    "(use a vision-language checkpoint)")
        return messages, ordered_images, ordered_videos

    def _tools(self, index: int, row: dict) -> Optional[list]:
        tools = row.get(self.tools_key) if self.tools_key in row else None
        if tools is None:
            return None
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as err:
                raise self._fail(index, f"{self.tools_key!r} is a string but not valid JSON ({err.msg})") from err
        tools = _none_free(to_plain(tools))
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise self._fail(index, f"{self.tools_key!r} must be a list of tool schemas (dicts)")
        return tools or None

    # ------------------------------------------------------------------ rendering
    def _renderer(self, has_media: bool):
        return self.processor if has_media else self.tokenizer

    def _render(self, index: int, messages: list[dict], tools, thinking, gen: bool = False, media=False) -> str:
        kwargs = dict(self.template_kwargs)
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        try:
            return apply_chat_template(self._renderer(media), messages, tokenize=False, add_generation_prompt=gen,
                                       tools=tools, **kwargs)
        except TemplateError as err:
            raise self._fail(index, f"the chat template rejected the conversation: {err}") from err

    def _segment_text(self, index: int, msgs: list[dict], tools, thinking, media: bool) -> str:
        """``msgs`` rendered as they appear after a user turn (the anchor turn's own text removed)."""
        base = self._render(index, [_ANCHOR], tools, thinking, media=media)
        full = self._render(index, [_ANCHOR] + msgs, tools, thinking, media=media)
        if not full.startswith(base):
            raise self._fail(index, "the chat template renders the first turn differently once more turns follow, "
                                    "so turns cannot be tokenised one by one")
        return full[len(base):]

    def _pieces(self, index: int, messages, tools, thinking, media: bool) -> list[_Piece]:
        starts = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        bounds = sorted({0, len(messages)} | set(starts) | {k + 1 for k in starts})
        gen_base = self._render(index, [_ANCHOR], tools, thinking, media=media)
        gen_prompt = self._render(index, [_ANCHOR], tools, thinking, gen=True, media=media)[len(gen_base):]
        pieces: list[_Piece] = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            msgs = messages[a:b]
            text = (self._render(index, msgs, tools, thinking, media=media) if a == 0
                    else self._segment_text(index, msgs, tools, thinking, media))
            if msgs[0]["role"] != "assistant":
                pieces.append(_Piece(text, False))
                continue
            head = self._header_len(gen_prompt, text)
            end = text.rfind(self.eos_text) if self.eos_text else -1
            end = len(text) if end < head else end + len(self.eos_text)
            if end <= head:
                raise self._fail(index, f"assistant message {a} renders to no trainable text")
            pieces += [_Piece(text[:head], False), _Piece(text[head:end], True), _Piece(text[end:], False)]
        return [p for p in pieces if p.text]

    def _header_len(self, gen_prompt: str, text: str) -> int:
        """Characters of ``text`` that the generation prompt also produces, cut back to a token boundary (a
        Qwen3-style prompt ending in ``<think>`` shares the ``<`` of a turn starting with ``<tool_call>``)."""
        head = _common_prefix_len(gen_prompt, text)
        if not getattr(self.tokenizer, "is_fast", False):
            return head
        offsets = self.tokenizer(text[:head], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        full = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ends = {end for _, end in full}
        while offsets and offsets[-1][1] not in ends | {0}:
            offsets = offsets[:-1]
        # The longest token-aligned prefix of the shared text whose tokens are also the whole turn's tokens.
        k = 0
        while k < min(len(offsets), len(full)) and offsets[k] == full[k]:
            k += 1
        return full[k - 1][1] if k else 0

    def _tokenize(self, text: str, images: list, videos: list):
        """(ids, multimodal inputs) of one text; media go through the processor, which expands their tokens."""
        if not images and not videos:
            return self.tokenizer.encode(text, add_special_tokens=False), {}
        out = dict(self.processor(text=[text], images=images or None, videos=videos or None, return_tensors="pt"))
        ids = torch.as_tensor(out.pop("input_ids"))[0].tolist()
        for key in ("attention_mask", "mm_token_type_ids", "second_per_grid_ts"):
            out.pop(key, None)  # per-token or non-forward keys; position ids carry what the model derives
        return ids, out

    def _assign_media(self, pieces: list[_Piece], images: list, videos: list) -> None:
        tokens = [(getattr(self.processor, "image_token", "<|image_pad|>"), images, "images"),
                  (getattr(self.processor, "video_token", "<|video_pad|>"), videos, "videos")]
        for token, pool, attr in tokens:
            it = iter(pool)
            for p in pieces:
                getattr(p, attr).extend(next(it) for _ in range(p.text.count(token)))

    def encode(self, index: int) -> dict:
        """Unpadded ``input_ids`` / ``loss_mask`` (and multimodal inputs) of row ``index``."""
        messages, images, videos, tools, thinking = self._messages(index)
        media = bool(images or videos)
        pieces = self._pieces(index, messages, tools, thinking, media)
        whole_text = self._render(index, messages, tools, thinking, media=media)
        if media:
            self._assign_media(pieces, images, videos)
        ids, mask = [], []
        for p in pieces:
            piece_ids, _ = self._tokenize(p.text, p.images, p.videos)
            ids += piece_ids
            mask += [int(p.trained)] * len(piece_ids)
        whole_ids, mm_inputs = self._tokenize(whole_text, images, videos)
        if ids != whole_ids:
            if not self.ignore_input_ids_mismatch:
                raise self._fail(index, self._mismatch(pieces, whole_text, ids, whole_ids))
            logger.warning("MultiTurnSFTDataset: row %d tokenises differently turn by turn; training on the "
                           "turn-by-turn ids (data.ignore_input_ids_mismatch=true)", index)
        return {"input_ids": ids, "loss_mask": mask, "multi_modal_inputs": mm_inputs, "media": media}

    def _mismatch(self, pieces, whole_text: str, ids: list[int], whole_ids: list[int]) -> str:
        joined = "".join(p.text for p in pieces)
        if joined != whole_text:
            at = _common_prefix_len(joined, whole_text)
            return ("tokenising turn by turn differs from tokenising the whole conversation: the chat template "
                    f"renders it differently as a whole (first difference at character {at}: turn by turn "
                    f"{joined[at:at + 40]!r}, whole {whole_text[at:at + 40]!r}; e.g. a template that drops earlier "
                    "reasoning). Set data.ignore_input_ids_mismatch=true to train on the turn-by-turn ids")
        at = _common_prefix_len(ids, whole_ids)
        return ("tokenising turn by turn differs from tokenising the whole conversation at token "
                f"{at} ({ids[at:at + 5]} vs {whole_ids[at:at + 5]}: the tokeniser merges text across a turn "
                "boundary). Set data.ignore_input_ids_mismatch=true to train on the turn-by-turn ids")

    # ------------------------------------------------------------------ items
    def __getitem__(self, index: int) -> dict:
        enc = self.encode(index)
        ids = torch.tensor(enc["input_ids"], dtype=torch.long)
        loss_mask = torch.tensor(enc["loss_mask"], dtype=torch.long)
        n = len(ids)
        if n > self.max_length:
            if self.truncation == "error":
                raise self._fail(index, f"the conversation is {n} tokens, longer than data.max_length="
                                        f"{self.max_length}; raise max_length or set data.truncation=left/right")
            if enc["media"]:
                raise self._fail(index, f"the conversation is {n} tokens (> data.max_length={self.max_length}) and "
                                        "has images/videos, whose tokens cannot be cut; raise data.max_length")
            keep = slice(n - self.max_length, n) if self.truncation == "left" else slice(0, self.max_length)
            ids, loss_mask = ids[keep], loss_mask[keep]
            if not loss_mask.any():
                raise self._fail(index, f"after {self.truncation} truncation to {self.max_length} tokens no "
                                        "assistant token is left")
        attention_mask = torch.ones_like(ids)
        if self.pad_mode == "right":
            pad = self.max_length - len(ids)
            ids = torch.cat([ids, torch.full((pad,), self.pad_token_id, dtype=torch.long)])
            attention_mask = torch.cat([attention_mask, torch.zeros(pad, dtype=torch.long)])
            loss_mask = torch.cat([loss_mask, torch.zeros(pad, dtype=torch.long)])
        item = {"input_ids": ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
                "position_ids": self._position_ids(ids, attention_mask, enc["multi_modal_inputs"])}
        if self.rope_indexer is not None:
            item["multi_modal_inputs"] = enc["multi_modal_inputs"]  # {} for text rows, so batches collate
        return item

    def _position_ids(self, ids: torch.Tensor, attention_mask: torch.Tensor, mm_inputs: dict) -> torch.Tensor:
        if self.rope_indexer is None:
            return (torch.cumsum(attention_mask, 0) - 1).clamp(min=0)
        from verl.utils.rope_index import compute_position_ids

        pos = compute_position_ids(ids.unsqueeze(0), attention_mask.unsqueeze(0), mm_inputs, self.rope_indexer,
                                   self.image_token_id, self.video_token_id)
        return pos[0].long()


def sft_collate_fn(rows: list[dict], pad_token_id: int = 0) -> dict:
    """Right-pad rows to the longest one in the batch (rows of ``pad_mode=right`` already share a length).

    Tensors come back stacked; ``multi_modal_inputs`` (VL models) as a numpy object array, one dict per row."""
    length = max(int(r["input_ids"].shape[-1]) for r in rows)
    out: dict[str, Any] = {}
    for key, fill in (("input_ids", pad_token_id), ("attention_mask", 0), ("loss_mask", 0), ("position_ids", None)):
        padded = []
        for r in rows:
            t = r[key]
            pad = length - t.shape[-1]
            if pad:
                # Positions of padding continue from the last one; they are masked out either way.
                value = t[..., -1:].expand(*t.shape[:-1], pad) if fill is None else t.new_full((*t.shape[:-1], pad), fill)
                t = torch.cat([t, value], dim=-1)
            padded.append(t)
        out[key] = torch.stack(padded)
    if "multi_modal_inputs" in rows[0]:
        arr = np.empty(len(rows), dtype=object)
        for i, r in enumerate(rows):
            arr[i] = r["multi_modal_inputs"]
        out["multi_modal_inputs"] = arr
    return out
