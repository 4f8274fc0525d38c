"""CLI: ``python -m verl.model_merger {merge,test} --backend fsdp --local_dir DIR ...`` (see the package doc)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verl.model_merger",
                                     description="Export a verl actor checkpoint as a Hugging Face model.")
    sub = parser.add_subparsers(dest="operation", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", required=True, choices=["fsdp", "megatron"],
                        help="training backend that wrote the checkpoint (this project writes fsdp)")
    common.add_argument("--local_dir", required=True, help="the checkpoint's actor directory (global_step_N/actor)")
    common.add_argument("--hf_model_path", default=None,
                        help="base HF model; with a LoRA checkpoint, merge actor/lora_adapter into it instead of "
                             "reading base weights from the shards")
    common.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code")
    merge = sub.add_parser("merge", parents=[common], help="write the merged HF model to --target_dir")
    merge.add_argument("--target_dir", required=True, help="output directory")
    merge.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                       help="dtype of the written weights (default: the model config's dtype, else float32)")
    test = sub.add_parser("test", parents=[common], help="compare the merged weights with an HF model directory")
    test.add_argument("--test_hf_dir", required=True, help="reference HF model directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.backend != "fsdp":
        print("this project trains with FSDP2 only; --backend megatron checkpoints do not exist here", file=sys.stderr)
        return 2
    from .fsdp_merger import compare_with_hf, merge_fsdp_checkpoint

    if args.operation == "merge":
        out = merge_fsdp_checkpoint(args.local_dir, args.target_dir, hf_model_path=args.hf_model_path,
                                    trust_remote_code=args.trust_remote_code, dtype=args.dtype)
        print(f"merged HF model written to {out}")
        return 0
    bad = compare_with_hf(args.local_dir, args.test_hf_dir, hf_model_path=args.hf_model_path,
                          trust_remote_code=args.trust_remote_code)
    if bad:
        print("mismatching tensors:\n  " + "\n  ".join(bad[:50]), file=sys.stderr)
        return 1
    print("all tensors match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
