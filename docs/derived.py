"""Write, or check, the numbers the pages state that follow from the code alone.

    python docs/derived.py            # rewrite every marked number in README.md and docs/*.md
    python docs/derived.py --check    # change nothing; exit 1 naming each page, line and number
                                      # whose text is not what the code gives now

A number a page states that the code decides (a parameter count, a size in bytes, a ratio of
two defaults, how many mistakes the bug zoo holds) is written between markers, invisible on a
rendered page:

    SimpleModel has <!--parameters-->204,960<!--/--> parameters

and NUMBERS below says how to compute it. `tests/test_docs.py` runs the check, so a change to
the model, the data or the zoo that moves such a number fails the suite (CI runs it on every
torch) until this script has rewritten the page. It takes seconds: nothing is trained.

Not marked: what a run measures. Timings vary from run to run, and losses and distances are
rounding, which another CPU's kernels (AVX-512 against AVX2, another BLAS) change in the last
digits: those name the command and the machine that produced them instead, and the tests
never compare with them (they compare each run with the oracle, on the same machine).
"""

import argparse
import ast
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402 (the repository's, found through the path above)

MARKED = re.compile(r"<!--([a-z0-9-]+)-->(.*?)<!--/-->")
WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen twenty twenty-one twenty-two twenty-three "
         "twenty-four twenty-five twenty-six twenty-seven twenty-eight twenty-nine thirty thirty-one "
         "thirty-two thirty-three thirty-four thirty-five thirty-six thirty-seven thirty-eight "
         "thirty-nine forty forty-one forty-two forty-three forty-four forty-five").split()


def parameters(**size):
    """The parameter count of SimpleModel at `size` (its defaults where not given)."""
    return sum(p.numel() for p in common.SimpleModel(**size).parameters())


def mistakes():
    """How many mistakes tests/test_zoo.py's MISTAKES holds (read, not imported: its import
    would need pytest's conftest)."""
    tree = ast.parse((REPO / "tests" / "test_zoo.py").read_text())
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "MISTAKES")
    return len(table.keys)


def fp64_lr_ratio():
    """The fp64 proof's learning rate against the scripts' default (tests/conftest.py)."""
    tests = ast.parse((REPO / "tests" / "conftest.py").read_text())
    job = next(node.value for node in tests.body if isinstance(node, ast.Assign)
               and getattr(node.targets[0], "id", None) == "FP64_JOB")
    lr = next(ast.literal_eval(k.value) for k in job.keywords if k.arg == "lr")  # dict(...)
    import single  # the baseline's defaults: every script has the same
    return lr / single.parse_args([]).lr


def block_parameters():
    """The parameter count of one of SimpleModel's blocks, at its defaults."""
    return sum(p.numel() for p in common.SimpleModel().blocks["0"].parameters())


def performance_model():
    """docs/performance.md's benchmark model."""
    return parameters(hidden=256, blocks=2, heads=4)


def checkpointing_model():
    """docs/compile.md's activation checkpointing model (docs/benchmarks.py checkpointing)."""
    return parameters(hidden=256, blocks=8, heads=4)


def memory_model():
    """docs/memory.md's model."""
    return parameters(hidden=384, blocks=4, heads=6)


# name: how the code gives it, as the pages write it. Sizes: docs/performance.md's benchmark
# model (--hidden 256 --blocks 2 --heads 4), docs/compile.md's checkpointing model (--hidden
# 256 --blocks 8 --heads 4), docs/memory.md's (--hidden 384 --blocks 4 --heads 6). MB = 1e6 bytes, MiB = 2**20, as the pages say.
NUMBERS = {
    "parameters": lambda: f"{parameters():,}",
    "parameters-m": lambda: f"{parameters() / 1e6:.1f}",
    "block-parameters": lambda: f"{block_parameters():,}",
    "ln-vocab": lambda: f"{math.log(common.VOCAB):.2f}",
    "loss-floor": lambda: f"{(common.PERIOD - 1) / common.SEQ_LEN * math.log(common.VOCAB):.2f}",
    "training-sequences": lambda: f"{common.DATASET_SIZE}",
    "mistakes": lambda: WORDS[mistakes()],
    "mistakes-capital": lambda: WORDS[mistakes()].capitalize(),
    "fp64-lr-ratio": lambda: f"{fp64_lr_ratio():.1f}",
    "performance-parameters-m": lambda: f"{performance_model() / 1e6:.1f}",
    "performance-gradient-mb": lambda: f"{performance_model() * 4 / 1e6:.1f}",
    "performance-state-mib": lambda: f"{performance_model() * 16 / 2**20:.1f}",
    "checkpointing-parameters-m": lambda: f"{checkpointing_model() / 1e6:.1f}",
    "memory-parameters-m": lambda: f"{memory_model() / 1e6:.1f}",
    "memory-psi-mb": lambda: f"{memory_model() * 4 / 1e6:.1f}",
    "memory-state-mb": lambda: f"{memory_model() * 16 / 1e6:.0f}",
}


def pages(root):
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def rewrite(root, write):
    """Every marked number that differs from what NUMBERS computes now, as (page, line, name,
    written, computed); rewrites the pages too if `write`. A marker with a name NUMBERS lacks
    is an error (a typo would otherwise check nothing)."""
    values, wrong = {}, []
    for page in pages(root):
        text = page.read_text()

        def fill(match, page=page, text=text):
            name, written = match.groups()
            if name not in NUMBERS:
                raise SystemExit(f"{page.relative_to(root)}: marker <!--{name}--> names no "
                                 f"number; docs/derived.py knows {', '.join(NUMBERS)}")
            if name not in values:
                values[name] = NUMBERS[name]()
            if written != values[name]:
                line = text.count("\n", 0, match.start()) + 1
                wrong.append((page.relative_to(root), line, name, written, values[name]))
            return f"<!--{name}-->{values[name]}<!--/-->"

        new = MARKED.sub(fill, text)
        if write and new != text:
            page.write_text(new)
    return wrong


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 where a page's number is stale")
    parser.add_argument("--root", type=Path, default=REPO,
                        help="the repository to read (default: this one)")
    args = parser.parse_args(argv)
    wrong = rewrite(args.root, write=not args.check)
    for page, line, name, written, computed in wrong:
        print(f"{page}:{line}: {name} says {written}, the code gives {computed}"
              f"{'' if args.check else ' (rewritten)'}")
    if args.check and wrong:
        raise SystemExit(f"{len(wrong)} stale number(s): run python docs/derived.py")


if __name__ == "__main__":
    main()
