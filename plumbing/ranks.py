"""How a process becomes a rank: the same in every distributed script, and none of its technique.

`python ddp.py` starts its own workers (launch, spawned) and gives each the environment
torchrun would (and a share of the cores' threads, where torchrun gives 1); under torchrun (or
srun, or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) each process is
one rank already. Before setup(), meet makes torchrun's environment ready for the group: a store
of the attempt's own (a restart's own keys) and the backend (NCCL only where every rank drives a
GPU of its own, told by the GPUs' UUIDs), so that every script's setup() calls
init_process_group as PyTorch's docs do. fail ends a process with one line.
"""

import datetime
import json
import multiprocessing
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def machine_gpus():
    """How many GPUs this process sees. torchrun and the scripts' own workers (`python ddp.py`)
    show every worker all of the machine's: then it is the machine's count, local rank r drives
    cuda:(r mod count), and more ranks than GPUs share them. Under a launcher a rank may see
    fewer: only its own (srun --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES, a container
    per rank), or the one GPU every task of the node sees too. A count cannot tell those apart;
    the GPUs' identities can, once the ranks meet (gpu_sharers, in every setup())."""
    return torch.cuda.device_count()


def gpu_sharers(store, device):
    """How many ranks of this machine drive the GPU this rank drives, itself included (1: a GPU
    of its own, as NCCL needs). Each rank publishes its GPU's UUID in the store the ranks meet
    in, under its machine's name and local rank, and reads the others': an index means nothing
    across processes (every rank of `srun --gpus-per-task=1` drives its own cuda:0, and two
    tasks on a one-GPU node drive the same cuda:0), a UUID names one physical GPU."""
    return sharing(store, int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]),
                   str(torch.cuda.get_device_properties(device).uuid))


def sharing(store, local_rank, local_world, uuid):
    """gpu_sharers, given what it reads: the local ranks whose GPU has this `uuid`.
    Waits (up to the store's timeout) until every rank of the machine has published its own."""
    machine = dist.PrefixStore(f"gpu_of_local_rank/{socket.gethostname()}", store)
    machine.set(str(local_rank), uuid)
    return sum(machine.get(str(r)).decode() == uuid for r in range(local_world))


def ranks(args, default, gpus, to_use_all):
    """The world size and the number of ranks on this machine, for parse_args' checks.

    torchrun's, which it sets for every worker; without a launcher, --nproc workers, `default`
    if it is not given (said in one line when that leaves GPUs idle, with `to_use_all`).
    """
    if "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if args.nproc is None:
        args.nproc = default
        if args.nproc < gpus:
            print(f"{os.path.basename(sys.argv[0])}: {args.nproc} of {gpus} GPUs, "
                  f"{to_use_all}", flush=True)
    return args.nproc, args.nproc


def meet(args):
    """What torchrun's environment needs before a script's setup() can call
    init_process_group(backend, timeout=..., device_id=...) as PyTorch's docs do, reading it
    (env://): none of it is a lesson, and every distributed script shares it.

    - A store of this attempt's own for the group (serve_group): torchrun keeps its store across
      restarts, and a restarted group would read the dead attempt's keys there.
    - The GPUs: NCCL needs a GPU of its own for every rank, told by the GPUs' UUIDs
      (gpu_sharers), not by counts; ranks (args.who: pipeline.py's stages) that share one stop
      in one line before the group, or (args.gpu_sharing: ddp.py, zero.py) share it over gloo,
      slowly, said in one line.
    - args.backend, "auto" resolved: NCCL where every rank drives a GPU of its own, else gloo.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rendezvous_store(rank, world_size, args.timeout)  # the launcher's, or rank 0's
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    # setup()'s device: LOCAL_RANK's GPU, modulo the GPUs this rank sees
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()) \
        if use_cuda else torch.device("cpu")
    sharers = gpu_sharers(store, device) if use_cuda else 1
    name = os.path.basename(sys.argv[0])
    backend = "nccl" if use_cuda else "gloo"
    if args.gpu_sharing:
        if args.backend != "auto" or sharers > 1:
            backend = "gloo" if args.backend == "auto" else args.backend
        if backend == "nccl" and sharers > 1:
            fail(f"{name}: error: {sharers} ranks, one GPU: use --backend gloo", every_rank=True)
        if sharers > 1 and rank == 0:
            # Host copies: a test setup; EXCLUSIVE_PROCESS GPUs refuse it
            # (docs/traps.md#gloo-on-gpus).
            print(f"{name[:-3]}: {sharers} ranks share a GPU over gloo: slow", flush=True)
    elif sharers > 1:
        fail(f"{name}: error: {sharers} {args.who} drive one GPU, and NCCL needs one GPU per "
             f"{args.who[:-1]}: use fewer {args.who}", every_rank=True)
    args.backend = backend
    serve_group(store, rank, world_size, args.timeout)


GROUP_STORE = None  # serve_group's store, alive as long as this process


def serve_group(store, rank, world_size, timeout_s):
    """Point torchrun's environment (MASTER_ADDR, MASTER_PORT) at a store of this attempt's own,
    which rank 0 hosts, on a port the OS picks, published in the launcher's `store` under this
    attempt's keys (docs/traps.md#restarts): init_process_group's env:// then meets there. Under
    a launcher without a store (srun's ranks), the store rank 0 hosts already (`store`'s).
    Either way env:// is told to join it, not to host one (TORCHELASTIC_USE_AGENT_STORE)."""
    global GROUP_STORE
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        if rank == 0:
            # On one machine, MASTER_ADDR is this one; across machines, its name as torchrun
            # gives it (its own store, under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
            one_machine = os.environ["WORLD_SIZE"] == os.environ["LOCAL_WORLD_SIZE"]
            host = (os.environ["MASTER_ADDR"] if one_machine
                    else socket.getfqdn(socket.gethostname()))
            GROUP_STORE = tcp_store(host, 0, world_size, is_master=True, timeout=timeout,
                                    wait_for_workers=False)
            store.set("group_store", f"{host} {GROUP_STORE.port}")
        host, port = store.get("group_store").decode().split()
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)
    else:
        GROUP_STORE = store
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    if sys.platform == "win32":
        os.environ["USE_LIBUV"] = "0"  # env://'s client: tcp_store's reason


def rendezvous_store(rank, world_size, timeout_s):
    """The store the ranks meet in before the group, to compare GPUs and publish the group's
    store in (meet). The launcher's (torchrun's agent, or launch() below), with keys of their own
    for every restart attempt: it outlives a restart, and the dead attempt's keys are still in it
    (docs/traps.md#restarts). Without one (srun's ranks), rank 0 hosts it at
    MASTER_ADDR:MASTER_PORT, where env:// would have hosted its own."""
    address = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return tcp_store(*address, world_size, is_master=rank == 0, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}",
                            tcp_store(*address, world_size, is_master=False, timeout=timeout))


def tcp_store(*args, **kwargs):
    """dist.TCPStore on every platform. Its default server since torch 2.4 is libuv, which
    PyTorch's Windows wheels have been built without: asked for it there, the store fails
    ("use_libuv was requested but PyTorch was build without libuv support", pytorch/pytorch
    #139990; torchrun on Windows needs USE_LIBUV=0 for the same reason). So TCPStore's older
    server on Windows; elsewhere, libuv."""
    return dist.TCPStore(*args, use_libuv=sys.platform != "win32", **kwargs)


def spawned(local_rank, run, args, port):
    """Entry point of a worker the script started itself: set the rank's environment torchrun
    would set, then run(args). One difference: its thread count (below)."""
    # Without a limit, N workers each start one thread per core and fight over the cores,
    # slower than fewer threads each. torchrun sets OMP_NUM_THREADS=1 unless you set it, which
    # leaves cores idle where the workers are fewer than the cores; here each worker gets an
    # equal share of them instead (cores // N: 1 each on 2 cores, 4 each for 2 workers on 8).
    # Your own OMP_NUM_THREADS wins, as it does under torchrun.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, os.cpu_count() // args.nproc))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.nproc),
                      LOCAL_WORLD_SIZE=str(args.nproc),
                      # The store is the launcher's, as under torchrun: rendezvous_store() joins it.
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    as_rank(run, args)


# How gloo says that a collective's peer is gone or never came (NCCL's errors are DistErrors).
PEER_LOST = ("Timed out waiting", "Application timeout", "Connection closed by peer",
             "Connection reset by peer")


def as_rank(run, args):
    """run(args) as one rank. A collective that gives up (a peer died, or never reached it
    within --timeout) ends the rank with one line, not a page of C++ frames: which rank, what
    gloo or NCCL said, and the two usual causes."""
    quiet_known_warnings()  # two that torch prints on these correct runs (why: its docstring)
    try:
        meet(args)  # all that setup()'s init_process_group needs first, and no lesson
        run(args)
        if args.backend == "gloo":
            # After destroy_process_group: lets gloo's threads drop their last tensors while
            # Python is alive; without it a worker can abort at exit with SIGABRT on torch 2.13
            # (docs/traps.md#sigabrt).
            time.sleep(0.2)
    except RuntimeError as e:  # torch.distributed.DistError is one
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not (isinstance(e, dist.DistError) or any(s in first for s in PEER_LOST)):
            raise
        said = first.split("] ")[-1].split(". ")[0]  # gloo's words, without its source file
        fail(f"{os.path.basename(sys.argv[0])}: error: rank {os.environ.get('RANK')}: a "
             f"collective gave up ({said}): a peer stopped, or the ranks did "
             f"not all make the same collectives (--timeout {args.timeout:g} s)",
             leave_group=False, every_rank=True)


def launch(run, args):
    """run(args) in this process if a launcher made it a rank; else in args.nproc workers on
    this machine, started here, with one exit status for all of them."""
    if not dist.is_available():  # a torch built without it (some macOS and Windows builds)
        fail(f"{os.path.basename(sys.argv[0])}: error: this torch {torch.__version__} has no "
             "torch.distributed; install PyTorch's wheel from pytorch.org (or use single.py)")
    if "RANK" in os.environ:
        as_rank(run, args)  # torchrun started one process per rank; this is one of them
        return
    # The rendezvous store, hosted here as torchrun's agent hosts its own: on a port the OS
    # picks and this process holds, so nothing can take it before the workers connect (a port
    # only found free, then bound by rank 0 seconds later, can be: "address already in use").
    store = tcp_store("127.0.0.1", 0, args.nproc, is_master=True, wait_for_workers=False)
    # start_processes passes each worker its index, waits for all, and if one fails it
    # terminates the others and raises here. Each worker is a new process (never a fork of this
    # one, which may hold threads): on Linux "forkserver" forks them from a fresh server that
    # has imported torch once; elsewhere "spawn" (Python's default there) imports it in each.
    method = "forkserver" if sys.platform == "linux" else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])
    try:
        mp.start_processes(spawned, args=(run, args, store.port), nprocs=args.nproc,
                           start_method=method)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        # A worker that stopped with a message of its own (a bad --checkpoint, say) has
        # printed it already and exited 1: end with its exit status, not with spawn's
        # dozen-line traceback under the message. Anything else (a crash, a signal): spawn's
        # message, which carries the worker's traceback, in place of ours.
        code = getattr(e, "exit_code", None)
        raise SystemExit(code if code is not None and code > 0
                         else f"{os.path.basename(sys.argv[0])}: {e}")


def fail(message, leave_group=True, every_rank=False):
    """Stop this process with `message` as its one error line (on stderr) and exit status 1.

    Under torchrun the line also goes into the error file torchrun gives each worker
    (TORCHELASTIC_ERROR_FILE), so the "Root Cause" at the bottom of torchrun's failure report
    repeats it, instead of "To enable traceback see: ...".
    The scripts call it where every rank stops at the same point for the same reason (a
    checkpoint that all of them read and refuse), so no peer waits inside a collective and
    NCCL's group can be left cleanly: it would otherwise warn at exit that
    destroy_process_group() was never called, under the one line. (A gloo group is left to the
    exit, as it always was: tearing it down here could abort the exit on torch 2.13,
    docs/traps.md#sigabrt.) leave_group=False where a peer may be stuck in a collective.
    """
    if leave_group and dist.is_initialized() and dist.get_backend() == "nccl":
        dist.destroy_process_group()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    # Said once: by rank 0 at once; the others wait a moment first, and the launcher, seeing
    # rank 0 fail, ends them before they say it again. (every_rank: a stop that depends on the
    # rank, its GPU or its peers, which each rank says at once.)
    if not every_rank and os.environ.get("RANK", "0") != "0":
        time.sleep(5)
    raise SystemExit(message)


def quiet_known_warnings():
    """Silence, in this process, exactly three messages that torch prints on correct runs of
    these scripts (every rank of every script calls it: as_rank), each harmless here:
    - FSDP2's "FSDP2-wrapped module (...) returned a view tensor ... can cause backward to fail
      or produce wrong gradients" (torch 2.13 and later, at the first forward; fsdp.py, and
      tp.py in 2D). An in-place op on a module's output would skip the backward hook FSDP
      registers on it. The root's output is the logits, a view (nn.Linear on batch x sequence
      x hidden folds it into one matrix product and views the result back), and nothing here
      writes into it in place.
    - DTensor's "2 sequential all_reduce (or all_gather) operations will be performed. This is
      suboptimal ... may give inconsistent results between ranks" (tp.py in 2D, once per rank):
      clip_grad_norm_ sums the norm of a gradient sharded over "dp" and "tp" over one, then
      the other (two all-reduces of one number each, where a flattened mesh, a private API
      today, would make one), and --save gathers a weight cut by both in two all-gathers.
      Every rank gets the same numbers all the same: an all-gather copies, and each all-reduce
      gives its group one result, the groups of the second adding up equal inputs.
    - torch 2.13's FutureWarning that all_gather_into_tensor and reduce_scatter_tensor are
      deprecated for all_gather_single and reduce_scatter_single (from_scratch/): torch 2.10
      has no *_single functions, and 2.15 no longer deprecates the two."""
    import logging
    import warnings
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\."
                            r"(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        lambda record: "This is suboptimal" not in record.getMessage())
