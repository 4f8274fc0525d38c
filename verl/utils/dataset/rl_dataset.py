"""Prompt dataset for RL post-training.

Every row holds a chat (``prompt_key``, default ``"prompt"``) plus pass-through columns such as
``data_source``, ``reward_model`` and ``extra_info``. A sample is the rendered chat tokenized and left-padded
to ``max_prompt_length`` (``input_ids`` / ``attention_mask`` / ``position_ids``), the unpadded
``raw_prompt_ids`` that rollout engines consume, and every other column untouched.

Rows are kept as plain Python dicts, so the dataset pickles cleanly (dataloader workers, checkpoints).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import os
import re
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from verl.utils.dataset.vision_utils import process_image, process_video
from verl.utils.config import cfg_get, to_plain

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
_PLACEHOLDER_RE = re.compile(r"(<image>|<video>)")
# Keys the chat helper always sets itself; letting a user config override them would change the output type.
_RESERVED_TEMPLATE_KWARGS = ("tokenize", "add_generation_prompt", "return_dict", "return_tensors")


def collate_fn(data_list: list[dict]) -> dict:
    """Stack tensor fields along a new batch dim; gather every other field into a 1-D numpy object array."""
    if not data_list:
        raise ValueError("collate_fn: received an empty batch (data_list is empty)")
    tensors: dict[str, list] = {}
    others: dict[str, list] = {}
    for sample in data_list:
        for key, value in sample.items():
            (tensors if isinstance(value, torch.Tensor) else others).setdefault(key, []).append(value)

    batch: dict[str, Any] = {}
    for key, values in {**tensors, **others}.items():
        if len(values) != len(data_list):
            raise ValueError(
                f"collate_fn: key {key!r} is present in {len(values)} of {len(data_list)} samples; "
                "every sample of a batch must have the same keys"
            )
    for key, values in tensors.items():
        batch[key] = torch.stack(values, dim=0)
    for key, values in others.items():
        # Filled element by element: np.array(values) would turn equal-length lists into a 2-D array.
        arr = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            arr[i] = value
        batch[key] = arr
    return batch


def _render_chat(tokenizer_or_processor, messages: list[dict], **kwargs) -> str:
    """The single place a chat is turned into prompt text.

    Goes through the shared helper so prompts match what the rollout renders (including Qwen3.5's
    fallback for chats without a user message).
    """
    from verl.utils.chat_template import apply_chat_template

    for key in _RESERVED_TEMPLATE_KWARGS:
        kwargs.pop(key, None)
    return apply_chat_template(tokenizer_or_processor, messages, add_generation_prompt=True, tokenize=False, **kwargs)


def truncate_ids(ids: list | torch.Tensor, max_length: int, mode: str):
    """Cut a 1-D sequence to ``max_length`` keeping its head (right), tail (left) or both ends (middle)."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[len(ids) - max_length :]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        tail = max_length - head
        if isinstance(ids, torch.Tensor):
            return torch.cat([ids[:head], ids[len(ids) - tail :]])
        return list(ids[:head]) + list(ids[len(ids) - tail :])
    raise ValueError(f"truncate_ids: unknown truncation mode {mode!r}; use one of {TRUNCATION_MODES}")


def _read_data_file(path: str, who: str = "RLHFDataset") -> list[dict]:
    """All rows of one parquet / json / jsonl file as plain dicts; ``who`` (the dataset class) opens errors."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{who}: data file {path!r} does not exist; check data.train_files / data.val_files"
        )
    lower = path.lower()
    try:
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        if lower.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        if lower.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                content = json.load(f)
            if isinstance(content, list):
                return content
            if isinstance(content, dict) and content and all(isinstance(v, list) for v in content.values()):
                n = len(next(iter(content.values())))
                return [{k: v[i] for k, v in content.items()} for i in range(n)]
            raise ValueError("expected a list of row objects or an object of equal-length column lists")
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{who}: could not read data file {path!r}: {err}") from err
    raise ValueError(f"{who}: unsupported data file {path!r}; use .parquet, .json or .jsonl")


class RLHFDataset(Dataset):
    """Chat prompts from parquet/json/jsonl files, tokenized and left-padded for RL rollouts.

    Args:
        data_files: one path or a list of paths.
        tokenizer: a HF tokenizer with a chat template (or ``custom_chat_template`` in ``config``).
        config: the ``data`` config section (DictConfig or dict); see the attributes set in ``__init__``.
        processor: a multimodal processor; needed only for rows that carry images or videos.
        max_samples: keep at most this many rows (``-1``: all); random when ``config.shuffle`` is set.
        model_config: the model's HF config (or its directory). For mRoPE models (Qwen3.5-VL) every row's
            ``position_ids`` are then ``(4, L)`` - text positions, then the t/h/w rows the model's own
            ``get_rope_index`` gives - so image and text rows collate together. Default: with a processor,
            the config next to the tokenizer (``tokenizer.name_or_path``) when there is one.
    """

    def __init__(self, data_files, tokenizer, config, processor=None, max_samples: int = -1, model_config=None):
        if isinstance(data_files, str | os.PathLike):
            data_files = [data_files]
        data_files = [os.path.expanduser(os.fspath(f)) for f in to_plain(data_files)]
        if not data_files:
            raise ValueError("RLHFDataset: no data files given")
        self.data_files = list(data_files)
        self.original_data_files = list(data_files)
        self.tokenizer = tokenizer
        self.processor = processor
        self.max_samples = max_samples
        self.config = config

        self.prompt_key = cfg_get(config, "prompt_key", "prompt")
        self.image_key = cfg_get(config, "image_key", "images")
        self.video_key = cfg_get(config, "video_key", "videos")
        self.max_prompt_length = int(cfg_get(config, "max_prompt_length", 1024))
        self.return_raw_chat = bool(cfg_get(config, "return_raw_chat", True))
        self.return_full_prompt = bool(cfg_get(config, "return_full_prompt", False))
        self.return_raw_input_ids = bool(cfg_get(config, "return_raw_input_ids", False))
        self.truncation = cfg_get(config, "truncation", "error")
        self.filter_overlong_prompts = bool(cfg_get(config, "filter_overlong_prompts", True))
        self.apply_chat_template_kwargs = dict(to_plain(cfg_get(config, "apply_chat_template_kwargs", {})))
        self.custom_chat_template = cfg_get(config, "custom_chat_template", None)
        self.need_tools_kwargs = bool(cfg_get(config, "need_tools_kwargs", False))
        self.return_multi_modal_inputs = bool(cfg_get(config, "return_multi_modal_inputs", True))
        # Upstream's default: the processor's own patch size when the key is unset (null).
        default_patch = getattr(getattr(processor, "image_processor", None), "patch_size", None) or 14
        self.image_patch_size = int(cfg_get(config, "image_patch_size", None) or default_patch)
        self.shuffle = bool(cfg_get(config, "shuffle", False))
        self.seed = cfg_get(config, "seed", None)
        self.serialize_dataset = False

        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"RLHFDataset: data.truncation={self.truncation!r} is not supported; use one of {TRUNCATION_MODES}"
            )
        if self.max_prompt_length <= 0:
            raise ValueError(f"RLHFDataset: data.max_prompt_length must be positive, got {self.max_prompt_length}")
        self._check_chat_template()
        self.pad_token_id = self._resolve_pad_token_id()
        self._init_rope_indexer(model_config)
        self._read_files_and_tokenize()

    # ------------------------------------------------------------------ setup
    def _check_chat_template(self):
        if self.custom_chat_template is not None:
            return
        owners = [self.tokenizer]
        if self.processor is not None:
            owners += [self.processor, getattr(self.processor, "tokenizer", None)]
        if not any(getattr(o, "chat_template", None) for o in owners if o is not None):
            raise ValueError(
                f"RLHFDataset: the tokenizer ({type(self.tokenizer).__name__}) has no chat template, so prompts "
                "cannot be rendered; use a chat/instruct tokenizer, or set data.custom_chat_template to a Jinja "
                "chat template string"
            )

    def _init_rope_indexer(self, model_config):
        """Set up mRoPE position ids (``self.rope_indexer``; None for text-position models)."""
        self.rope_indexer = None
        self._model_config = None
        self.image_token_id = self.video_token_id = None
        if model_config is None and self.processor is None:
            return  # text-only model: no processor, plain positions
        if model_config is None or isinstance(model_config, str | os.PathLike):
            path = model_config if model_config is not None else getattr(self.tokenizer, "name_or_path", None)
            model_config = None
            if path and os.path.isfile(os.path.join(os.path.expanduser(os.fspath(path)), "config.json")):
                from transformers import AutoConfig

                trust = bool(cfg_get(self.config, "trust_remote_code", False))
                try:
                    model_config = AutoConfig.from_pretrained(os.path.expanduser(os.fspath(path)),
                                                              trust_remote_code=trust)
                except (OSError, ValueError) as err:
                    logger.warning("RLHFDataset: could not read the model config at %s (%s); multimodal rows "
                                   "get text position ids", path, err)
        if model_config is None:
            return
        from verl.utils.rope_index import rope_indexer_from_config

        self.rope_indexer = rope_indexer_from_config(model_config)
        self._model_config = model_config if self.rope_indexer is not None else None  # rebuilt after unpickling
        if self.rope_indexer is not None:
            self.image_token_id = getattr(model_config, "image_token_id", None)
            self.video_token_id = getattr(model_config, "video_token_id", None)

    def _position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mm_inputs) -> torch.Tensor:
        """``(L,)`` text positions, or ``(4, L)`` for mRoPE models (shared with the agent loop's helper)."""
        if self.rope_indexer is None:
            return torch.clamp(torch.cumsum(attention_mask, dim=0) - 1, min=0).long()
        from verl.utils.rope_index import compute_position_ids

        pos = compute_position_ids(input_ids.unsqueeze(0), attention_mask.unsqueeze(0), mm_inputs,
                                   self.rope_indexer, self.image_token_id, self.video_token_id)
        return pos[0].long()

    def _resolve_pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "eos_token_id", None)
        if pad is None:
            raise ValueError("RLHFDataset: the tokenizer has neither pad_token_id nor eos_token_id to pad prompts with")
        return int(pad)

    def _read_files_and_tokenize(self):
        rows: list[dict] = []
        origins: list[tuple[str, int]] = []
        for path in self.data_files:
            file_rows = _read_data_file(path)
            rows.extend(file_rows)
            origins.extend((path, i) for i in range(len(file_rows)))
        # Files may have different columns; give every row every key so batches collate.
        all_keys: dict[str, None] = {}
        for row in rows:
            all_keys.update(dict.fromkeys(row))
        for row in rows:
            for key in all_keys:
                row.setdefault(key, None)
        logger.info("RLHFDataset: read %d rows from %d file(s)", len(rows), len(self.data_files))

        total = len(rows)
        if 0 < self.max_samples < total:
            if self.shuffle:
                rng = np.random.default_rng(self.seed)
                keep = sorted(rng.choice(total, size=self.max_samples, replace=False).tolist())
            else:
                keep = list(range(self.max_samples))
            rows = [rows[i] for i in keep]
            origins = [origins[i] for i in keep]

        self.dataframe = rows
        self._origins = origins
        self.maybe_filter_out_long_prompts()

    def maybe_filter_out_long_prompts(self):
        """Drop rows whose rendered prompt is longer than ``max_prompt_length`` (when enabled)."""
        if not self.filter_overlong_prompts:
            return self.dataframe
        kept_rows, kept_origins = [], []
        for row, origin in zip(self.dataframe, self._origins, strict=True):
            if len(self._encode(row, origin)["input_ids"]) <= self.max_prompt_length:
                kept_rows.append(row)
                kept_origins.append(origin)
        dropped = len(self.dataframe) - len(kept_rows)
        if dropped:
            logger.warning(
                "RLHFDataset: filtered out %d of %d prompts longer than max_prompt_length=%d",
                dropped,
                len(self.dataframe),
                self.max_prompt_length,
            )
        self.dataframe, self._origins = kept_rows, kept_origins
        return self.dataframe

    def resume_dataset_state(self):
        """Re-read the original files (rows are part of the pickled state, so this is only a refresh)."""
        self.data_files = list(self.original_data_files)
        self._read_files_and_tokenize()

    def __getstate__(self):
        # Plain-dict rows, tokenizer and config all pickle; the mRoPE indexer (bound methods of the model
        # class) is rebuilt from the model config.
        state = self.__dict__.copy()
        state["rope_indexer"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.__dict__.get("_model_config") is not None:
            from verl.utils.rope_index import rope_indexer_from_config

            self.rope_indexer = rope_indexer_from_config(self._model_config)

    def __len__(self):
        return len(self.dataframe)

    # ------------------------------------------------------------ per row
    @staticmethod
    def _where(origin: tuple[str, int]) -> str:
        return f"row {origin[1]} of {origin[0]}"

    def _build_messages(self, example: dict, key: str, origin: tuple[str, int] = ("<memory>", -1)) -> list[dict]:
        """A deep copy of the row's chat, with ``<image>``/``<video>`` placeholders made structured content."""
        if key not in example or example[key] is None:
            present = sorted(k for k, v in example.items() if v is not None)
            raise KeyError(
                f"RLHFDataset: {self._where(origin)} has no prompt under data.prompt_key={key!r}; "
                f"the row has keys {present}. Set data.prompt_key to the column holding the chat messages"
            )
        messages = to_plain(example[key])
        if isinstance(messages, np.ndarray):
            messages = messages.tolist()
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(
                f"RLHFDataset: {self._where(origin)}: {key!r} must be a list of chat messages like "
                f'[{{"role": "user", "content": "..."}}], got {type(messages).__name__}: {str(messages)[:120]}'
            )
        messages = copy.deepcopy(messages)
        n_images = len(example.get(self.image_key) or [])
        n_videos = len(example.get(self.video_key) or [])
        if not n_images and not n_videos:
            return messages
        if self.processor is None:
            raise ValueError(
                f"RLHFDataset: {self._where(origin)} has images/videos but no processor was given; "
                "pass the model's processor to the dataset"
            )
        seen = {"<image>": 0, "<video>": 0}
        for message in messages:
            content = message.get("content")
            if not isinstance(content, str):
                continue
            parts = []
            for piece in _PLACEHOLDER_RE.split(content):
                if piece in seen:
                    seen[piece] += 1
                    parts.append({"type": piece[1:-1]})
                elif piece:
                    parts.append({"type": "text", "text": piece})
            message["content"] = parts
        if seen["<image>"] != n_images or seen["<video>"] != n_videos:
            raise ValueError(
                f"RLHFDataset: {self._where(origin)} has {seen['<image>']} <image> and {seen['<video>']} <video> "
                f"placeholders but {n_images} images and {n_videos} videos; they must match one to one"
            )
        return messages

    def _template_kwargs(self) -> dict:
        kwargs = dict(self.apply_chat_template_kwargs)
        if self.custom_chat_template is not None:
            kwargs["chat_template"] = self.custom_chat_template
        return kwargs

    def _encode(self, row: dict, origin: tuple[str, int]) -> dict:
        """Render and tokenize one row (unpadded); also returns the vision inputs for multimodal rows."""
        messages = self._build_messages(row, self.prompt_key, origin)
        images = [process_image(x, self.image_patch_size) for x in (row.get(self.image_key) or [])]
        try:
            # (frames, metadata) pairs: the metadata dates the frames for the processor's timestamps
            videos = [process_video(x, self.image_patch_size, return_video_metadata=True)
                      for x in (row.get(self.video_key) or [])]
        except (ImportError, ValueError, TypeError, FileNotFoundError) as err:
            raise type(err)(f"RLHFDataset: {self._where(origin)}: {err}") from err
        multimodal = bool(images or videos)
        renderer = self.processor if (self.processor is not None and multimodal) else self.tokenizer
        try:
            raw_prompt = _render_chat(renderer, messages, **self._template_kwargs())
        except Exception as err:
            raise ValueError(f"RLHFDataset: could not apply the chat template to {self._where(origin)}: {err}") from err
        out = {"messages": messages, "raw_prompt": raw_prompt, "multi_modal_data": None, "multi_modal_inputs": None}
        if not multimodal:
            ids = self.tokenizer.encode(raw_prompt, add_special_tokens=False)
            out["input_ids"] = torch.tensor(ids, dtype=torch.long)
            out["attention_mask"] = torch.ones(len(ids), dtype=torch.long)
            return out
        video_kwargs = {}
        if videos:
            # Frames are sampled already: the processor must not sample them again.
            video_kwargs = {"video_metadata": [meta for _, meta in videos], "do_sample_frames": False}
        inputs = dict(self.processor(text=[raw_prompt], images=images or None,
                                     videos=[frames for frames, _ in videos] or None, return_tensors="pt",
                                     **video_kwargs))
        inputs.pop("video_metadata", None)
        out["input_ids"] = torch.as_tensor(inputs.pop("input_ids"))[0]
        mask = inputs.pop("attention_mask", None)
        out["attention_mask"] = torch.as_tensor(mask)[0] if mask is not None else torch.ones_like(out["input_ids"])
        inputs.pop("second_per_grid_ts", None)  # not a model forward argument
        # Per unpadded token, so it cannot travel with padded batches; position ids already carry what the
        # model derives from it, and engines rebuild it from the token ids.
        inputs.pop("mm_token_type_ids", None)
        out["multi_modal_data"] = {k: v for k, v in (("image", images), ("video", videos)) if v}
        out["multi_modal_inputs"] = inputs
        return out

    def _pad_left(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, origin, multimodal: bool):
        n, limit = len(input_ids), self.max_prompt_length
        if n > limit:
            if self.truncation == "error":
                raise ValueError(
                    f"RLHFDataset: the prompt of {self._where(origin)} is {n} tokens, longer than "
                    f"data.max_prompt_length={limit}; set data.truncation to left/right/middle, "
                    "data.filter_overlong_prompts=True, or raise data.max_prompt_length"
                )
            if multimodal:
                # Cutting a multimodal prompt would separate vision tokens from their pixel inputs.
                raise ValueError(
                    f"RLHFDataset: the multimodal prompt of {self._where(origin)} is {n} tokens "
                    f"(> max_prompt_length={limit}) and cannot be truncated safely; "
                    "enable data.filter_overlong_prompts or raise data.max_prompt_length"
                )
            input_ids = truncate_ids(input_ids, limit, self.truncation)
            attention_mask = truncate_ids(attention_mask, limit, self.truncation)
        pad = limit - len(input_ids)
        input_ids = torch.cat([torch.full((pad,), self.pad_token_id, dtype=input_ids.dtype), input_ids])
        attention_mask = torch.cat([torch.zeros(pad, dtype=attention_mask.dtype), attention_mask])
        return input_ids.long(), attention_mask.long()

    def __getitem__(self, item: int) -> dict:
        row = dict(self.dataframe[item])
        origin = self._origins[item]
        enc = self._encode(row, origin)
        multimodal = enc["multi_modal_data"] is not None
        input_ids, attention_mask = self._pad_left(enc["input_ids"], enc["attention_mask"], origin, multimodal)
        # Positions count only real tokens; left padding sits at position 0.
        position_ids = self._position_ids(input_ids, attention_mask, enc["multi_modal_inputs"])

        row.pop(self.prompt_key, None)
        row.pop(self.image_key, None)
        row.pop(self.video_key, None)
        row["input_ids"] = input_ids
        row["attention_mask"] = attention_mask
        row["position_ids"] = position_ids
        # The text prompt before vision-token expansion: what a rollout engine re-expands itself.
        raw_ids = self.tokenizer.encode(enc["raw_prompt"], add_special_tokens=False)
        if len(raw_ids) > self.max_prompt_length and self.truncation != "error":
            raw_ids = truncate_ids(raw_ids, self.max_prompt_length, self.truncation)
        row["raw_prompt_ids"] = list(raw_ids)
        if multimodal or self.rope_indexer is not None:
            # A VL model's text-only rows carry empty ones, so mixed batches collate (same keys everywhere).
            row["multi_modal_data"] = enc["multi_modal_data"] or {}
            if self.return_multi_modal_inputs:
                row["multi_modal_inputs"] = enc["multi_modal_inputs"] or {}
        if self.return_raw_chat:
            row["raw_prompt"] = enc["messages"]
        if self.return_full_prompt:
            row["full_prompts"] = enc["raw_prompt"]
        if self.return_raw_input_ids:
            row["raw_input_ids"] = input_ids[attention_mask.bool()].tolist()

        extra_info = row.get("extra_info")
        extra_info = dict(extra_info) if isinstance(extra_info, dict) else {}
        row["extra_info"] = extra_info
        row["index"] = extra_info.get("index", 0)
        row["tools_kwargs"] = extra_info.get("tools_kwargs") or {}
        row["interaction_kwargs"] = extra_info.get("interaction_kwargs") or {}
        if extra_info.get("need_tools_kwargs", self.need_tools_kwargs) and not row["tools_kwargs"]:
            logger.warning("RLHFDataset: tools_kwargs is empty for %s (index %s)", self._where(origin), row["index"])
        return row

    def split(self, num_splits: int) -> list[RLHFDataset]:
        """Contiguous, equal-sized shards (the remainder is dropped)."""
        if not isinstance(num_splits, int) or num_splits <= 0:
            raise ValueError(f"RLHFDataset.split: num_splits must be a positive integer, got {num_splits!r}")
        size = len(self) // num_splits
        if size == 0:
            raise ValueError(f"RLHFDataset.split: {len(self)} rows cannot be split into {num_splits} non-empty parts")
        shards = []
        for k in range(num_splits):
            shard = copy.copy(self)
            shard.dataframe = self.dataframe[k * size : (k + 1) * size]
            shard._origins = self._origins[k * size : (k + 1) * size]
            shards.append(shard)
        return shards


def _load_object_from_path(path: str, name: str, what: str):
    """``getattr(module, name)`` where module is a ``.py`` file path or an importable module (``pkg://`` ok)."""
    path = os.path.expanduser(str(path))
    if path.startswith("pkg://"):
        module = importlib.import_module(path[len("pkg://") :])
    elif path.endswith(".py") or os.path.sep in path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what}: file {path!r} does not exist")
        module_name = f"_verl_custom_{abs(hash(os.path.abspath(path)))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # lets pickling/dataclasses resolve the module again
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            raise RuntimeError(f"{what}: error while importing {path!r}: {err}") from err
    else:
        module = importlib.import_module(path)
    if not hasattr(module, name):
        raise AttributeError(f"{what}: {path!r} defines no object named {name!r}")
    return getattr(module, name)


def get_dataset_class(data_config):
    """``data.custom_cls.{path,name}`` when set (must subclass torch Dataset), else :class:`RLHFDataset`."""
    custom = cfg_get(data_config, "custom_cls", None)
    if custom is not None and custom.get("path"):
        if not custom.get("name"):
            raise ValueError("data.custom_cls.path is set but data.custom_cls.name is empty; name the dataset class")
        cls = _load_object_from_path(custom["path"], custom["name"], "data.custom_cls")
        if not (isinstance(cls, type) and issubclass(cls, Dataset)):
            raise TypeError(
                f"data.custom_cls: {custom['name']!r} from {custom['path']!r} must be a subclass of "
                "torch.utils.data.Dataset"
            )
        return cls
    return RLHFDataset


def create_rl_dataset(data_paths, data_config, tokenizer, processor, is_train: bool = True, max_samples: int = -1,
                      model_config=None):
    """Build the train/val dataset with the class chosen by :func:`get_dataset_class`.

    ``model_config`` (the model's HF config or directory) is passed on only when given, so custom dataset
    classes without that argument keep working.
    """
    del is_train  # kept for interface compatibility; train and val are built the same way
    dataset_cls = get_dataset_class(data_config)
    extra = {"model_config": model_config} if model_config is not None else {}
    return dataset_cls(
        data_files=data_paths, tokenizer=tokenizer, processor=processor, config=data_config, max_samples=max_samples,
        **extra,
    )


def create_rl_sampler(data_config, dataset):
    """A seeded random sampler when ``data.shuffle`` is on, else sequential.

    torchdata's RandomSampler is preferred because it checkpoints its position; torch's is the fallback.
    """
    from torch.utils.data import SequentialSampler

    if not cfg_get(data_config, "shuffle", False):
        return SequentialSampler(data_source=dataset)
    generator = torch.Generator()  # unseeded generators start from torch's fixed default seed
    seed = cfg_get(data_config, "seed", None)
    if seed is not None:
        generator.manual_seed(int(seed))
    try:
        from torchdata.stateful_dataloader.sampler import RandomSampler
    except ImportError:
        from torch.utils.data import RandomSampler
    return RandomSampler(data_source=dataset, generator=generator)
