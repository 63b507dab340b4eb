"""The README and docs/ link only to files that exist, every picture and page, and name only
flags the scripts have; the diffs the README recommends stay the size it says; every number a
page states that the code decides is what the code gives now (docs/derived.py)."""

import ast
import contextlib
import difflib
import functools
import importlib
import importlib.util
import io
import re
import shutil

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_image_and_page_a_page_links_exists(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    missing = [link for link in local if not (page.parent / link).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"
    if page.name == "README.md":  # the front page shows the proof
        assert "docs/proof.png" in local


def headings(page):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens ("Where a step's time goes: `--profile`" -> where-a-steps-time-goes---profile)."""
    anchors, in_code = set(), False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        if not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_section_a_page_links_to_exists(page):
    links = re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text())
    missing = [f"{target}#{anchor}" for target, anchor in links
               if (target == "" or target.endswith(".md"))
               and anchor not in headings(page.parent / target if target else page)]
    assert not missing, f"{page.name} links to missing sections: {missing}"


# The by-hand twins (from_scratch/) are named by their path from the repo's root, without .py.
BY_HAND = ["from_scratch/ddp", "from_scratch/zero", "from_scratch/fsdp", "from_scratch/tp",
           "from_scratch/pipeline"]
SCRIPTS = ["single", "dataparallel", "ddp", "zero", "diloco", "amp", "pipeline", "fsdp", "tp", "cp", "ep",
           "nd", *BY_HAND]


@functools.lru_cache(maxsize=None)
def flags_of(script):
    """The flags `script`.py's parser defines (the shared ones, plumbing/flags.py's, and its
    own): the option lines of its --help."""
    module = importlib.import_module(script.replace("/", "."))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.parse_args(["--help"])
    return set(re.findall(r"^ +(?:-h, )?(--[a-z0-9-]+)", out.getvalue(), re.M))


def flags_named_for_scripts(text):
    """(script, flag) for every flag written after a script's name in a command: on one line of
    a code block, or inside one `inline code` span."""
    pieces = [*re.findall(r"`([^`\n]+)`", text),
              *(line for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
                for line in block.splitlines())]
    found = set()
    for piece in pieces:
        piece = piece.split("#")[0]  # a shell comment names no flag
        # the longest name first, and none inside another's path: from_scratch/ddp.py is not ddp.py
        names = "|".join(sorted(SCRIPTS, key=len, reverse=True))
        for m in re.finditer(r"(?<![\w/])(" + names + r")\.py\b(.*)", piece):
            found |= {(m.group(1), flag) for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)",
                                                                 m.group(2))}
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_flag_a_page_names_after_a_script_is_one_that_script_has(page):
    wrong = sorted((script, flag) for script, flag in flags_named_for_scripts(page.read_text())
                   if flag not in flags_of(script))
    assert not wrong, f"{page.name} names flags the script does not have: {wrong}"


def test_the_flags_check_sees_a_flag_a_script_does_not_have():
    named = flags_named_for_scripts("run `python ddp.py --nproc 2 --zero2`, then\n```\n"
                                    "torchrun --nproc_per_node=2 fsdp.py --replicate 2\n"
                                    "python from_scratch/ddp.py --nproc 3\n```\n")
    assert named == {("ddp", "--nproc"), ("ddp", "--zero2"), ("fsdp", "--replicate"),
                     ("from_scratch/ddp", "--nproc")}
    assert "--zero2" not in flags_of("ddp") and "--nproc" in flags_of("ddp")


def test_usage_md_lists_every_flag_of_every_script():
    listed = set(re.findall(r"`(--[a-z0-9-]+)", (REPO / "docs" / "usage.md").read_text()))
    missing = sorted((script, flag) for script in SCRIPTS
                     for flag in flags_of(script) - {"--help"} if flag not in listed)
    assert not missing, f"docs/usage.md does not list: {missing}"


# The diffs the README recommends, and the most changed lines each may have: design limits,
# not the sizes of the day (past its limit, a diff shows more than its technique). Each
# number's reason:
DIFF_LIMITS = {
    # the wrapper, its home device, the GPUs it counts, the unwrap to save: 35
    ("single", "dataparallel"): 35,
    # autocast, the GradScaler (scale, unscale_ before clipping, step, update), --dtype, and
    # the scaler's state in the checkpoint: 60
    ("single", "amp"): 60,
    # the process group, the sampler and set_epoch, the wrapper, no_sync, the exact
    # evaluation (the padded batch forwarded whole, then cut), the all-reduced loss, the rank-0
    # save, the launcher, the global count of the targets that count (one all-reduce of an
    # integer a step, the loss times N): 125
    ("single", "ddp"): 125,
    # the sharded optimizer, its consolidation for a one-device checkpoint: 30
    ("ddp", "zero"): 30,
    # no wrapper, no global count, no no_sync: each replica steps alone on its own count; the
    # outer copy and its Nesterov SGD, the inner optimizer's choice, the round's flat
    # all-reduce and reset, a mid-round checkpoint of every replica gathered to rank 0 (its
    # DiLoCo flags saved and checked), the outer weights evaluated and saved: 190
    ("ddp", "diloco"): 190,
    # meta device, fully_shard and its order, rank-0 init, the optimizer after it, DCP's save
    # and load at the line (get_state_dict only once a checkpoint is found: its trap); HSDP,
    # --reshard-after-forward and bf16, which are fully_shard's own arguments: 155
    ("ddp", "fsdp"): 155,
    # the TP plan read from the model (its kinds made torch's styles), the mesh, data by TP
    # group, 2D, sequence and loss parallelism, tied weights kept one DTensor, what was cut
    # checked, the first block found wherever the model holds it (SP), a tuple's DTensors made
    # local; fsdp.py's options kept in 2D (HSDP's mesh of the same ranks): 210
    ("fsdp", "tp"): 210,
    # the pieces and their positions, the grid of data x context ranks and the sampler over its
    # rows, attention across the ranks written out three times (all-gather, ring and Ulysses'
    # all-to-all, each an autograd function of public collectives), the loss printed over every
    # rank, the count of a rank's pieces' targets, packed documents masked by position and
    # document across the ranks (the pieces' docs, gathered; the ring's per chunk pair): 250
    ("ddp", "cp"): 250,
    # the all-to-all dispatch and combine (an autograd function of public collectives), the
    # experts cut, every gradient summed over exactly its holders, the clip over the EP group,
    # and the checkpoint in one device's shape, the global count's factor N said for
    # sync_grads: 185
    ("ddp", "ep"): 185,
    # nd.py imports the pipeline's pieces (its schedules, cut, placement and checks leave), has
    # no model-parallel path, adds the mesh and its check, a stage's TP and FSDP, the per-stage
    # optimizers and their full state, built on "meta" and filled from rank 0's CPU: a file to
    # read (lesson 11): 555
    ("pipeline", "nd"): 555,
    # Each wrapper written by hand with public collectives, the rest of its script unchanged:
    # DDP's buckets, hooks and async all-reduces; ZeRO's shards of Adam and of the gradient;
    # FSDP's flat shards, gathers and reduce-scatters; TP's two autograd functions and the cut;
    # the pipeline's sends, receives and two schedules: 220 each
    **{(wrapper.removeprefix("from_scratch/"), wrapper): 220 for wrapper in BY_HAND},
    # FSDP's twin also finds each block's unit wherever the model holds it: 225
    ("fsdp", "from_scratch/fsdp"): 225,
    # TP's twin also removes tp.py's 2D mesh with fsdp.py's options, sequence and loss
    # parallelism and sharded checkpoints (some 180 lines, each refused in one line): 390
    ("tp", "from_scratch/tp"): 390}
# pipeline.py changes most of ddp.py: the course reads it as a file (lesson 6), not as a diff.

# Whole files: a technique and its training loop, read in one sitting.
# tp.py: 2D with fsdp.py's options; cp.py: three ways to reach the rest of the sequence
FILE_LIMITS = {"single": 200, "ddp": 262, "tp": 460, "cp": 505}
TECHNIQUE_LIMIT = 450  # every other script
PARSE_ARGS_LIMIT = 30  # the script's own flags and checks; the shared ones are plumbing/'s
MODEL_LIMIT = 250  # common.py: the model, its data and its loss, read like nanoGPT's model.py
PLUMBING_LIMIT = 300  # each file of plumbing/: one concern


def test_each_script_and_its_parse_args_stay_within_the_design_targets():
    for script in SCRIPTS:
        text = (REPO / f"{script}.py").read_text()
        limit = FILE_LIMITS.get(script, TECHNIQUE_LIMIT)
        assert len(text.splitlines()) <= limit, f"{script}.py: over {limit} lines"
        parse_args = next(node for node in ast.parse(text).body
                          if isinstance(node, ast.FunctionDef) and node.name == "parse_args")
        n = parse_args.end_lineno - parse_args.lineno + 1
        assert n <= PARSE_ARGS_LIMIT, f"{script}.py: parse_args has {n} lines"


@pytest.mark.parametrize("twin", BY_HAND)
def test_each_by_hand_twin_has_its_wrappers_skeleton_and_flags(twin):
    """`diff X.py from_scratch/X.py` shows the wrapper written by hand and nothing else: the
    same parts in the same order, and every flag of the wrapper (one it leaves out is refused
    in one line, not missing)."""
    wrapper = twin.removeprefix("from_scratch/")

    def parts(script):
        return [node.name for node in ast.parse((REPO / f"{script}.py").read_text()).body
                if isinstance(node, ast.FunctionDef)]
    shared = [name for name in parts(twin) if name in parts(wrapper)]
    assert shared == [name for name in parts(wrapper) if name in shared]
    assert {"parse_args", "setup", "evaluate", "train", "run", "main"} <= set(shared)
    assert flags_of(wrapper) <= flags_of(twin), flags_of(wrapper) - flags_of(twin)


def test_common_py_is_the_model_its_data_and_its_loss_and_names_its_extension_points():
    """common.py imports torch only (no plumbing, no script), defines the model, the data and
    the loss and nothing else, within MODEL_LIMIT lines; each extension point its docstring
    names exists where it says."""
    import common
    text = (REPO / "common.py").read_text()
    assert len(text.splitlines()) <= MODEL_LIMIT
    tree = ast.parse(text)
    imported = {name.split(".")[0] for node in ast.walk(tree)
                for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                             else [node.module] if isinstance(node, ast.ImportFrom) else [])}
    assert imported == {"torch"}
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert defined == {"Attention", "Expert", "MoE", "Block", "SimpleModel", "balance_loss",
                       "documents", "loss_fn", "make_dataset", "seed_everything"}
    points = re.findall(r"\b([A-Z]\w+\.\w+)\s\(", ast.get_docstring(tree))
    assert len(points) == 4, points
    for point in points:
        owner, name = point.split(".")
        assert hasattr(getattr(common, owner), name) or name == "blocks", point


def test_plumbing_is_small_files_that_only_define_and_hold_nothing_dead():
    """Each file of plumbing/ within PLUMBING_LIMIT lines; importing one does nothing but
    define things (imports, definitions, constants, a __main__ guard); every name it defines
    is used outside its own definition by a script or another file of plumbing/ (the tests
    do not count: a function only the tests call is dead)."""
    files = sorted((REPO / "plumbing").glob("*.py"))
    users = {path: path.read_text() for path in [*REPO.glob("*.py"), *files]}
    for path in files:
        text = users[path]
        assert len(text.splitlines()) <= PLUMBING_LIMIT, path.name
        for node in ast.parse(text).body:
            if isinstance(node, ast.If):
                assert ast.unparse(node.test) == "__name__ == '__main__'", path.name
                continue
            assert isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                                     ast.Assign, ast.Try, ast.Expr)), (path.name, node.lineno)
            if isinstance(node, ast.Expr):  # the docstring only
                assert isinstance(node.value, ast.Constant), (path.name, node.lineno)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign)):
                name = node.name if not isinstance(node, ast.Assign) else node.targets[0].id
                uses = sum(len(re.findall(rf"\b{name}\b", other)) for other in users.values())
                assert uses > 1, f"plumbing/{path.name}: {name} is used nowhere"


EXTRA_FILES = {"nd": ["pipeline.py", "tp.py", "cp.py"]}  # what nd.py imports besides the two below


def test_each_script_copied_with_what_the_readme_says_into_an_empty_folder_starts(tmp_path):
    """The README's "What to copy": a script, common.py and plumbing/ (nd.py: pipeline.py
    and tp.py too) in an empty folder, and the script starts and parses its flags there."""
    from conftest import launch_together, ok, python_cmd
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "`common.py` and the `plumbing/` folder" in readme
    assert all(f"`{name}`" in readme for names in EXTRA_FILES.values() for name in names)
    commands = []
    for script in SCRIPTS:
        folder = tmp_path / script.replace("/", "-")
        (folder / script).parent.mkdir(parents=True)
        for name in [f"{script}.py", "common.py", *EXTRA_FILES.get(script, [])]:
            shutil.copy(REPO / name, folder / name)
        shutil.copytree(REPO / "plumbing", folder / "plumbing",
                        ignore=shutil.ignore_patterns("__pycache__"))
        commands.append(python_cmd(folder / f"{script}.py", "--help", "--device=cpu"))
    for script, result in zip(SCRIPTS, launch_together(commands)):
        assert "--batch-size" in ok(result), script


def changed_lines(before, after):
    """Lines that `diff -u before after` adds or removes, the module docstrings left out."""
    def body(text):
        docstring = ast.parse(text).body[0]
        return text.splitlines()[docstring.end_lineno:]
    diff = difflib.unified_diff(body(before), body(after), lineterm="", n=0)
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def added_and_removed(before, after):
    """(lines added, lines removed) of changed_lines' diff."""
    def body(text):
        return text.splitlines()[ast.parse(text).body[0].end_lineno:]
    diff = [line for line in difflib.unified_diff(body(before), body(after), lineterm="", n=0)
            if not line.startswith(("+++", "---"))]
    return sum(line[:1] == "+" for line in diff), sum(line[:1] == "-" for line in diff)


def test_from_scratch_md_counts_each_twins_changed_lines_as_the_diff_does():
    """Its table's column of changed lines, and the paragraph's lines added and removed."""
    page = (REPO / "docs" / "from_scratch.md").read_text()
    table = dict(re.findall(r"^\| `from_scratch/(\w+)\.py` \|.*\| (\d+) \|[^|]*\|$", page, re.M))
    assert sorted(table) == sorted(name.removeprefix("from_scratch/") for name in BY_HAND)
    for name, n in table.items():
        before, after = ((REPO / folder / f"{name}.py").read_text()
                         for folder in ("", "from_scratch"))
        assert int(n) == changed_lines(before, after), name
    tp = added_and_removed((REPO / "tp.py").read_text(), (REPO / "from_scratch/tp.py").read_text())
    assert f"It adds {tp[0]} lines and removes {tp[1]}, {sum(tp)} in all." in " ".join(page.split())
    fsdp = added_and_removed((REPO / "fsdp.py").read_text(),
                             (REPO / "from_scratch/fsdp.py").read_text())
    assert f"The FSDP twin removes {fsdp[1]} lines" in " ".join(page.split())


def test_changed_lines_counts_what_a_diff_adds_and_removes_outside_the_docstring():
    script = '"""Docstring."""\n\nimport os\n\nx = 1\n'
    assert changed_lines(script, script.replace("Docstring", "Another docstring")) == 0
    assert changed_lines(script, script.replace("x = 1", "x = 2\ny = 3")) == 3


def test_each_recommended_diff_stays_within_its_limit_and_the_readme_shows_its_size():
    table = {(a, b): int(n) for a, b, n in re.findall(
        r"^\| `diff ([\w/]+)\.py ([\w/]+)\.py` \|.*\| (\d+) \|$", (REPO / "README.md").read_text(),
        re.M)}
    assert set(table) == set(DIFF_LIMITS), "README's table of diffs lists other diffs"
    for (a, b), limit in DIFF_LIMITS.items():
        n = changed_lines((REPO / f"{a}.py").read_text(), (REPO / f"{b}.py").read_text())
        assert table[a, b] == n, f"README says diff {a}.py {b}.py changes {table[a, b]} lines: {n}"
        assert limit is None or n <= limit, f"diff {a}.py {b}.py: {n} changed lines, over {limit}"


def derived():
    """docs/derived.py, imported from its file (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("derived", REPO / "docs" / "derived.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_planning_pages_tables_are_what_its_script_computes_now():
    """docs/planning.md's layouts are docs/planning.py's arithmetic (its small-scale check
    against nd.py, which takes a minute of launches, is run by hand: the page says how)."""
    spec = importlib.util.spec_from_file_location("planning", REPO / "docs" / "planning.py")
    planning = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planning)
    page = (REPO / "docs" / "planning.md").read_text()
    tables = re.search(r"<!--planning-tables-->\n(.*)\n<!--/planning-tables-->", page, re.S)
    assert tables.group(1) == planning.tables().strip()


def test_the_planning_pages_small_scale_check_is_its_formula_and_the_counts_equal_it():
    """Each row of the page's check (pasted from `python docs/planning.py --check`, which runs
    nd.py) shows the formula the script computes now, and a count equal to it."""
    spec = importlib.util.spec_from_file_location("planning", REPO / "docs" / "planning.py")
    planning = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planning)
    page = (REPO / "docs" / "planning.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\d+) x (\d+) x (\d+) x (\d+) \| (\w+)(?:, CP (\w+))? \| "
                      r"stage [^|]+ \|(.*)\|$", page, re.M)
    assert [(int(r[0]), int(r[1]), int(r[3]), int(r[4]), r[5], r[6] or None) for r in rows] == [
        tuple(c) for c in planning.CHECKS]
    for ranks, pp, _, cp, tp, schedule, _, cells in rows:
        expected = planning.formula(int(ranks), int(pp), int(cp), int(tp), schedule)[2]
        pairs = [cell.replace(",", "").split() for cell in cells.split("|")]
        assert pairs[0] == [f"{expected['state']:.4f}", f"{expected['state']:.3f}"]
        for key, (shown, seen) in zip(("send", "tp", "dp", "cp"), pairs[1:]):
            assert float(shown) == float(seen) == expected[key], (ranks, schedule, key)


def test_every_number_a_page_derives_from_the_code_is_what_the_code_gives_now():
    """Parameter counts, sizes, the zoo's size...: `python docs/derived.py` rewrites them."""
    assert derived().rewrite(REPO, write=False) == []


def test_the_derived_numbers_check_fails_on_a_page_whose_number_changed_and_rewrites_it(
        tmp_path, capsys):
    """The check, on a copy of the pages with one marked number changed by hand: it names the
    page, the line and both values, and exits non-zero; without --check it rewrites the page
    and the check passes again. A marker naming no number is an error, not a silent pass."""
    shutil.copy(REPO / "README.md", tmp_path)
    shutil.copytree(REPO / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    readme = tmp_path / "README.md"
    text = readme.read_text()
    count = re.search(r"<!--parameters-->([0-9,]+)<!--/-->", text)
    readme.write_text(text.replace(count.group(0), "<!--parameters-->1,234<!--/-->"))
    line = text.count("\n", 0, count.start()) + 1
    script = derived()
    with pytest.raises(SystemExit, match="1 stale number"):
        script.main(["--check", f"--root={tmp_path}"])
    assert capsys.readouterr().out == (f"README.md:{line}: parameters says 1,234, the code gives "
                                       f"{count.group(1)}\n")
    script.main([f"--root={tmp_path}"])
    assert readme.read_text() == text
    script.main(["--check", f"--root={tmp_path}"])
    readme.write_text(text.replace(count.group(0), "<!--parameter-->1<!--/-->"))
    with pytest.raises(SystemExit, match="marker <!--parameter--> names no number"):
        script.main(["--check", f"--root={tmp_path}"])


def test_each_exercise_can_be_run_alone_by_the_k_expression_its_row_gives():
    """docs/exercises.md's "run it alone" lines: one per row of the zoo's table, each `-k`
    expression a part of exactly one test's name in tests/test_zoo.py (and of nothing pytest
    also matches -k against: the file and folder names)."""
    import ast
    text = (REPO / "docs" / "exercises.md").read_text()
    rows = re.findall(r"^\| (\d+) \| \*\*", text, re.M)
    lines = re.findall(r"^python -m pytest -q tests/test_zoo\.py -k (\S+) +# (\d+)$", text, re.M)
    assert [n for _, n in lines] == rows, "one line per row of the table, in order"
    tests = [node.name for node in ast.parse((REPO / "tests" / "test_zoo.py").read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    for expression, row in lines:
        matched = [t for t in tests if expression.lower() in t.lower()]
        assert len(matched) == 1, f"row {row}: -k {expression} selects {matched}"
        assert expression.lower() not in "tests/test_zoo.py", f"row {row}: -k {expression}"


def test_each_by_hand_exercise_can_be_run_alone_by_the_k_expression_its_row_gives():
    """docs/exercises.md's by-hand rows (H1, H2, ...): one "run it alone" line each, in order,
    whose `-k` selects exactly one test of the module it names."""
    import ast
    text = (REPO / "docs" / "exercises.md").read_text()
    rows = re.findall(r"^\| (H\d+) \| \*\*", text, re.M)
    lines = re.findall(r"^python -m pytest -q (tests/test_\w+\.py) -k (\S+) +# (H\d+)$", text,
                       re.M)
    assert rows and [n for *_, n in lines] == rows, "one line per row of the table, in order"
    for module, expression, row in lines:
        tests = [node.name for node in ast.parse((REPO / module).read_text()).body
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
        matched = [t for t in tests if expression.lower() in t.lower()]
        assert len(matched) == 1, f"row {row}: -k {expression} selects {matched}"
        assert expression.lower() not in module, f"row {row}: -k {expression}"


def test_lesson_0s_four_calls_are_a_file_that_runs_and_the_page_quotes_it():
    """course.md's lesson 0 shows the code of docs/collective.py, line for line, and that file,
    launched as the page says, leaves each of 2 ranks with the sum 1 + 2."""
    from conftest import launch, ok, torchrun_cmd
    code = (REPO / "docs" / "collective.py").read_text()
    body = code[code.index("rank = int("):].splitlines()  # after the imports: the lesson
    block = re.search(r"\[collective\.py\]\(collective\.py\).*?```python\n(.*?)```",
                      (REPO / "docs" / "course.md").read_text(), re.S).group(1)
    assert block.splitlines() == body
    out = ok(launch(*torchrun_cmd(2, "docs/collective.py")))
    # (the two ranks share torchrun's stdout: their lines may interleave)
    assert sorted(re.findall(r"rank (\d): \[3\.0, 3\.0, 3\.0, 3\.0\]", out)) == ["0", "1"]
