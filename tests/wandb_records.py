"""Read back what a W&B run wrote to disk: the records of its run-<id>.wandb file.

The file is W&B's transaction log, the one `wandb sync` uploads: a 7-byte header (":W&B", magic 0xBEE1,
version 0), then LevelDB's log format (32 KiB blocks of chunks: crc32 u32, length u16, type u8 FULL=1 FIRST=2
MIDDLE=3 LAST=4), each record a wandb_internal.Record protobuf, decoded with W&B's own message classes.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK, HEADER, CHUNK = 32768, 7, 7


def raw_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), f"{path}: not a .wandb file"
    records, parts, pos = [], [], HEADER
    while pos + CHUNK <= len(data):
        if BLOCK - pos % BLOCK < CHUNK:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK])
        if kind == 0:  # zeroed tail of the file
            break
        parts.append(data[pos + CHUNK:pos + CHUNK + length])
        pos += CHUNK + length
        if kind in (1, 4):  # FULL or LAST: a record ends here
            records.append(b"".join(parts))
            parts = []
    return records


@dataclass
class WandbRun:
    run_id: str = ""
    project: str = ""
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one dict per logged row, with "_step"
    summary: dict[str, Any] = field(default_factory=dict)


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: Path) -> WandbRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = WandbRun()
    for data in raw_records(path):
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project, run.name = rec.run.run_id, rec.run.project, rec.run.display_name
            run.config.update({_key(i): json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            run.config.update({_key(i): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            run.summary.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
    return run
