"""Flags more than one ``kvhandoff`` subcommand takes."""

from __future__ import annotations

import argparse


def tls_channel_args(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help=f"{who}connect with TLS, verifying the server with this CA")
    p.add_argument("--tls-client-cert", default=None, metavar="PEM",
                   help=f"{who}client certificate for mutual TLS")
    p.add_argument("--tls-client-key", default=None, metavar="PEM")


def model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory, or a generated model: 'builtin' "
                        "(the default), 'bench', or a variant of another architecture "
                        "('qwen2-gqa-tied', 'llama-mqa-bf16')")
