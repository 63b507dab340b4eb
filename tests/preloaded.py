"""The tests' launcher: one process imports torch once, then forks each process a test starts.

A new process pays for `import torch` and torch.distributed's modules before it runs a line of
a script: about 3-4 s of CPU on the CUDA build of torch, measured with `python -X importtime`.
The suite starts over a hundred processes on two cores, so it would spend minutes importing.
Forked from this server (which has done nothing but import), a process starts with those
modules in memory, and is otherwise what `python script.py` makes: its own session (so one
killpg ends it and its workers), environment, working directory, sys.argv, sys.path, standard
streams (files), priority and thread count; it runs the script as __main__ and exits with its
status; SIGUSR1 makes it print every thread's Python stack (faulthandler), so a test that
gives up on a hung process shows where each rank waited. Only CPU runs come here
(conftest.start): the server never touches CUDA, yet a process forked after CUDA starts could
not use it.

Run by conftest.py as `python tests/preloaded.py`; it reads one JSON request per line on stdin:
  {"id": N, "cwd": dir, "out": file, "err": file or null (with out), "nice": n,
   "procs": [{"argv": [script, args...], "env": {...}}, ...]}   start them
  {"kill": N, "signal": name}          send them a signal (SIGKILL when no name is given)
and writes {"id": N, "rc": status} on stdout when every process of request N has ended. As a
launcher does, it kills the rest of a request's processes as soon as one of them fails.
"""

import json
import os
import select
import signal
import sys

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS threads: fork only a single thread

import numpy  # noqa: E402,F401
import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.pipelining  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401
try:  # Hugging Face's models, where tests/requirements.txt installed them
    import transformers  # noqa: E402,F401
except ImportError:
    pass


def run(proc, request, replies):
    """In the forked child: become `python argv...` and never return."""
    import atexit
    import faulthandler
    import runpy
    import traceback
    os.setsid()
    os.nice(request["nice"])
    os.close(replies)  # so that the tests see the server's replies end when it does
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(proc["env"])
    out = os.open(request["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) \
        if request["err"] else out
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # in place of the server's requests
    os.dup2(out, 1)
    os.dup2(err, 2)
    line = 1 if os.environ.get("PYTHONUNBUFFERED") else -1
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=line, closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, when asked
    if "OMP_NUM_THREADS" in os.environ:  # read by OpenMP when torch loaded, here, before
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if os.environ.get("CUDA_DEFAULTS_ON_CPU") == "1":  # conftest.CUDA_DEFAULTS: as Python
        # would at the start of a new process, with that folder on PYTHONPATH
        runpy.run_path(os.path.join(os.path.dirname(__file__), "cuda_defaults",
                                    "sitecustomize.py"))
    script = os.path.abspath(proc["argv"][0])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [os.path.dirname(script), *extra]  # as python does for `python script`
    sys.argv = list(proc["argv"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main():
    requests, pid_of = {}, {}  # id: {"live": its running pids, "rc": status}; pid: id
    stdin, stdout = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # no stray print can garble the replies
    buffer = b""

    def kill(pids, sig=signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(pid, sig)  # its session's group: its workers too
            except ProcessLookupError:
                pass

    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if ready:
            data = os.read(stdin, 1 << 16)
            if not data:  # the tests ended: so do their processes
                for request in requests.values():
                    kill(request["live"])
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                if "kill" in message:
                    if message["kill"] in requests:
                        kill(requests[message["kill"]]["live"],
                             getattr(signal, message.get("signal", "SIGKILL")))
                    continue
                pids = set()
                for proc in message["procs"]:
                    pid = os.fork()
                    if pid == 0:
                        run(proc, message, stdout)
                    pids.add(pid)
                    pid_of[pid] = message["id"]
                requests[message["id"]] = {"live": pids, "rc": 0}
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            request_id = pid_of.pop(pid)
            request = requests[request_id]
            request["live"].discard(pid)
            rc = os.waitstatus_to_exitcode(status)
            if rc and not request["rc"]:
                request["rc"] = rc  # the first failure, as a launcher reports it
                kill([pid, *request["live"]])
            if not request["live"]:
                del requests[request_id]
                os.write(stdout, json.dumps({"id": request_id, "rc": request["rc"]})
                         .encode() + b"\n")


if __name__ == "__main__":
    main()
