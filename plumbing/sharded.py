"""Sharded checkpoints (fsdp.py, tp.py): the folder's bookkeeping and a data-only loader.

--checkpoint is a folder of DCP checkpoints, one subfolder per step, and a file `latest`
naming the complete one. A new step is written beside the old one (step_folder), and `latest`
is switched to it with one atomic os.replace only once it is complete: a crash at any moment
leaves `latest` naming a whole checkpoint. Then the old one is removed. latest_checkpoint finds
the one `latest` names and checks it can be continued; load_sharded reads it as data, never as
code. A bad one is refused in one line.
"""

import contextlib
import json
import os
import pickle
import shutil

import torch
import torch.distributed as dist

from plumbing.checkpoints import check_resumable, train_state
from plumbing.ranks import fail


@contextlib.contextmanager
def step_folder(args, step):
    """The folder to write step `step` into, beside the last one (a collective write, such as
    dcp.save, goes inside the `with`); after it, rank 0 commits it: `latest` names it."""
    name = f"step_{step:08d}"
    yield os.path.join(args.checkpoint, name)
    if dist.get_rank() == 0:  # dcp.save returned: every rank's shards and the index are written
        commit_sharded(args.checkpoint, name, train_state(args, step))


def latest_checkpoint(args, script):
    """The train state of the step `latest` names in --checkpoint (its "step", and its
    "folder" for load_sharded), or None where the folder holds no checkpoint yet. One this run
    cannot continue, or that cannot be one, stops every rank with one line naming `script`
    (its __file__) and is left as it was. Reads small files only: every rank calls it before
    any collective, and all get the same answer."""
    def refuse(why):
        fail(f"{os.path.basename(script)}: error: --checkpoint {args.checkpoint}: {why}")

    folder, saved = latest_sharded(args.checkpoint, refuse)
    if folder is None:
        return None
    check_resumable(saved, args, refuse)  # the same --batch-size, --seed, --fp64
    return {**saved, "folder": folder, "refuse": refuse}


def load_sharded(state, found):
    """dcp.load(state) from the checkpoint latest_checkpoint `found`, read as data only."""
    read_data_only(state, found["folder"], found["refuse"])


def commit_sharded(folder, name, train_state):
    """On rank 0, once every rank has written folder/name: its train state (small, the same on
    every rank) as train_state.json, then `latest` switched to it, then the older steps gone."""
    with open(os.path.join(folder, name, "train_state.json"), "w") as f:
        json.dump(train_state, f)
    tmp = os.path.join(folder, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, "latest"))
    for old in os.listdir(folder):
        if old.startswith("step_") and old != name:
            shutil.rmtree(os.path.join(folder, old))
    print(f"checkpoint: step {train_state['step']} -> {folder}/{name}", flush=True)


def latest_sharded(folder, refuse):
    """(the step folder `latest` names, its train state), or (None, None) where `folder` holds
    no checkpoint yet; refuse(why) where it cannot be one. Reads small files only: every rank
    calls it before any collective, and all get the same answer."""
    if not os.path.exists(folder):
        return None, None
    if not os.path.isdir(folder):
        refuse("is a file; fsdp.py and tp.py keep sharded checkpoints in a folder: "
               "point elsewhere")
    latest = os.path.join(folder, "latest")
    if not os.path.exists(latest):
        if os.listdir(folder):
            refuse("this folder holds no checkpoint of fsdp.py or tp.py (no 'latest' file); "
                   "point --checkpoint at a new or empty folder")
        return None, None
    try:
        with open(latest) as f:
            step_folder = os.path.join(folder, f.read().strip())
        with open(os.path.join(step_folder, "train_state.json")) as f:
            return step_folder, json.load(f)
    except (OSError, ValueError) as e:
        refuse(f"cannot be read ({type(e).__name__}); move it away or point elsewhere")


# The classes a checkpoint index (.metadata) of torch.distributed.checkpoint is made of: DCP's
# own metadata dataclasses, the file reader's storage record, and the torch types they hold.
DCP_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
}


class NotCheckpointData(pickle.UnpicklingError):
    """A pickle that names a class or function no checkpoint index holds."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP index and refuses any other class or function (os.system, say)."""

    def find_class(self, module, name):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in DCP_METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise NotCheckpointData(f"{module}.{name}")


def read_data_only(state, folder, refuse):
    """dcp.load(state, checkpoint_id=folder), reading the checkpoint as data, never as code;
    refuse(why) where it cannot be read, on every rank alike.

    torch trusts a DCP folder: it reads the index (.metadata) with a plain pickle.load, and every
    non-tensor value in the shards (the optimizer's lr, betas...) with torch.load(weights_only=
    False), so a hostile folder runs any code it names on load (pytorch/pytorch#189308). Here
    the index goes through MetadataUnpickler and each value through weights_only=True first.
    Before any collective, every rank checks what the files alone can tell (the index, each
    shard present and long enough) and raises ValueError with the reason: the same files give
    the same answer on every rank, so all stop together. What goes wrong later, inside
    dcp.load, raises DCP's CheckpointException on every rank.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        _load_data_only(state, folder)
    except ValueError as e:  # found before any collective, the same on every rank
        refuse(f"{e}; move it away or point elsewhere")
    except (Exception, CheckpointException) as e:  # raised on every rank by the collective
        # (CheckpointException derives from BaseException: `except Exception` misses it.)
        refuse(f"cannot be read ({type(e).__name__}); move it away or point elsewhere")


def _load_data_only(state, folder):
    """read_data_only's work: ValueError for what the files alone show, then dcp.load."""
    # Imported here: only the sharded scripts need it, and it takes most of a second.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class DataOnlyReader(dcp.FileSystemReader):
        def read_metadata(self):  # (no **kwargs: DCP then skips its per-rank fallback)
            with open(os.path.join(self.path, ".metadata"), "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class DataOnlyPlanner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            # The default unpickles with weights_only=False. The same bytes through
            # weights_only=True first: anything but plain data stops here.
            torch.load(value, weights_only=True)
            value.seek(0)
            super().load_bytes(read_item, value)

    reader = DataOnlyReader(folder)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise ValueError("its index (.metadata) is missing")
    except NotCheckpointData as e:
        raise ValueError(f"its index (.metadata) calls {e}, which no checkpoint does: "
                         "refused, nothing was run")
    except Exception as e:  # empty, truncated, garbage
        raise ValueError(f"its index (.metadata) cannot be read ({type(e).__name__})")
    if not isinstance(metadata, Metadata) or not metadata.storage_data:
        raise ValueError("its index (.metadata) is not a checkpoint's")
    for info in metadata.storage_data.values():
        shard = os.path.join(folder, str(info.relative_path))
        if not os.path.isfile(shard):
            raise ValueError(f"shard {info.relative_path} is missing")
        if os.path.getsize(shard) < info.offset + info.length:
            raise ValueError(f"shard {info.relative_path} is cut short")
    dcp.load(state, storage_reader=reader, planner=DataOnlyPlanner())
