"""A small fork repository in git for the review tests: two upstream files with
architecture gates, a series, its gate policy, expectation rows and a lock,
committed on `main`, with a branch `pr` checked out for the change under review."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hermetic
from forkrepo import edit, make_patch, write_tree
from sm120fork import cli
from sm120fork.upstream import lock

OLMO2 = "python/sglang/srt/arg_groups/olmo2.py"
MOE = "python/sglang/srt/layers/moe.py"
OLMO2_PATCH = "sm120-olmo2-attention-triton.patch"
MOE_PATCH = "sm120-moe-runner.patch"
ARCHS = ("sm80", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121")

_FILLER = "".join(f"\n\ndef _helper_{i}(args):\n    return args\n" for i in range(6))

OLMO2_0_5_9 = '''"""Model overrides (test copy)."""

from sglang.srt.platform import get_platform


def _olmo2_overrides(cfg):
    overrides = {}
    if cfg.attention_backend is None:
        if get_platform().is_sm100:
            overrides["attention_backend"] = "trtllm_mha"
        elif get_platform().device_sm >= 80:
            overrides["attention_backend"] = "fa3"
        else:
            overrides["attention_backend"] = "triton"
    return overrides
'''
# 0.5.10 adds a logger at the top: the patch applies 4 lines further down.
OLMO2_0_5_10 = edit(
    OLMO2_0_5_9,
    "from sglang.srt.platform import get_platform\n",
    "import logging\n\nfrom sglang.srt.platform import get_platform\n\nlog = logging.getLogger()\n",
)

MOE_0_5_9 = (
    '''"""MoE runner choice (test copy)."""

from sglang.srt.utils import is_sm100_supported, is_sm120_supported


def pick_moe_runner(args):
    if is_sm100_supported():
        args.moe_runner_backend = "flashinfer_trtllm"
    return args
'''
    + _FILLER
    + "\n\ndef _unrelated(args):\n    return args\n"
)
# 0.5.10 changes a function far from the patch.
MOE_0_5_10 = edit(
    MOE_0_5_9,
    "def _unrelated(args):\n    return args\n",
    "def _unrelated(args):\n    return dict(args)\n",
)

UPSTREAM = {
    "0.5.9": {OLMO2: OLMO2_0_5_9, MOE: MOE_0_5_9},
    "0.5.10": {OLMO2: OLMO2_0_5_10, MOE: MOE_0_5_10},
}
OLMO2_LINE = "        if get_platform().is_sm100:\n" + (
    '            overrides["attention_backend"] = "trtllm_mha"\n'
)
MOE_LINE = '        args.moe_runner_backend = "flashinfer_trtllm"\n'


def olmo2_patch(condition: str = "get_platform().is_sm120", version: str = "0.5.9") -> str:
    base = UPSTREAM[version]
    added = f'        elif {condition}:\n            overrides["attention_backend"] = "triton"\n'
    changed = {OLMO2: edit(base[OLMO2], OLMO2_LINE, OLMO2_LINE + added)}
    return make_patch("Default Olmo2 attention to triton on SM12x", base, changed)


def moe_patch(condition: str = "is_sm120_supported()", version: str = "0.5.9") -> str:
    base = UPSTREAM[version]
    added = f'    elif {condition}:\n        args.moe_runner_backend = "flashinfer_cutlass"\n'
    changed = {MOE: edit(base[MOE], MOE_LINE, MOE_LINE + added)}
    return make_patch("Pick the CUTLASS MoE runner on SM12x", base, changed)


def lock_text(version: str) -> str:
    wheel = f"sglang-{version}-py3-none-any.whl"
    return lock.dumps(
        lock.Lock(
            version=version,
            tag=f"v{version}",
            source="pypi",
            imported="2026-11-29",
            tree_from=wheel,
            license_from=f"{wheel}:sglang-{version}.dist-info/licenses/LICENSE",
            artifacts=(lock.Artifact(wheel, "0" * 64, 1),),
        )
    )


def policy(
    moe: str = 'decision = "excluded"\nreason = "TRT-LLM MoE kernels are SM100 only"',
) -> str:
    return f'''[wrongly_included]
tokens = []

[[file]]
path = "{OLMO2}"

[[file.gate]]
function = "_olmo2_overrides"
condition = "get_platform().is_sm100"
decision = "excluded"
reason = "trtllm_mha is SM100 only"

[[file.gate]]
function = "_olmo2_overrides"
condition = "get_platform().device_sm >= 80"
decision = "patched"
patch = "{OLMO2_PATCH}"
reason = "FA3 has no SM12x kernels; the patch sends SM12x to triton first"

[[file]]
path = "{MOE}"

[[file.gate]]
function = "pick_moe_runner"
condition = "is_sm100_supported()"
{moe}
'''


def row(scenario: str, field: str, cells: Mapping[str, str], patch: str | None = None) -> str:
    lines = ["[[row]]", f'scenario = "{scenario}"', f'field = "{field}"']
    if patch:
        lines.append(f'patch = "{patch}"')
    lines += [f'{arch} = "{cells[arch]}"' for arch in ARCHS]
    return "\n".join(lines) + "\n\n"


def cells(default: str, **special: str) -> dict[str, str]:
    return {arch: special.get(arch, default) for arch in ARCHS}


OLMO2_ROW = row(
    "olmo2_tp1",
    "attention_backend",
    cells("fa3", sm100="trtllm_mha", sm103="trtllm_mha", sm120="triton", sm121="triton"),
    OLMO2_PATCH,
)


@dataclass(frozen=True)
class ReviewRepo:
    root: Path

    def git(self, *args: str) -> str:
        """Git in the fixture repository, under the test seal (the tool's own git
        drops GIT_* variables, the seal's identities included)."""
        return hermetic.git(*args, cwd=self.root).stdout.rstrip("\n")

    def write(self, files: Mapping[str, str | None]) -> None:
        """Write (or, for None, delete) files given by their path in the repository."""
        for path, text in files.items():
            if text is None:
                (self.root / path).unlink()
            else:
                write_tree(self.root, {path: text})

    def commit(self, message: str, files: Mapping[str, str | None] | None = None) -> str:
        self.write(files or {})
        self.git("add", "-A", ".")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD")

    def review(self, *args: str) -> int:
        return cli.main(["-C", str(self.root), "review", *args])

    @property
    def out(self) -> Path:
        return self.root / "build" / "review"

    def markdown(self) -> str:
        return (self.out / "review.md").read_text(encoding="utf-8")

    def json(self) -> Any:
        return json.loads((self.out / "review.json").read_text(encoding="utf-8"))


def fork_files(version: str, patches: Mapping[str, str], expectations: str) -> dict[str, str]:
    files = {f"vendor/sglang/{path}": text for path, text in UPSTREAM[version].items()}
    files |= {f"patches/{name}": text for name, text in patches.items()}
    files["patches/series"] = "".join(f"{name}\n" for name in patches)
    files["patches/gates.toml"] = policy()
    files["gatetable/expectations.toml"] = expectations
    files["vendor/sglang.lock"] = lock_text(version)
    files[".gitignore"] = "/build/\n"
    return files


def make_review_repo(root: Path, *, moe: bool = False) -> ReviewRepo:
    """The fork on sglang 0.5.9 with the Olmo2 patch (and the MoE one), committed on
    main; branch `pr` checked out."""
    root.mkdir(parents=True)
    repo = ReviewRepo(root)
    repo.git("init", "-q", ".")
    patches = {OLMO2_PATCH: olmo2_patch()}
    expectations = OLMO2_ROW
    if moe:
        patches[MOE_PATCH] = moe_patch()
        expectations += row(
            "moe_fp4",
            "moe_runner_backend",
            cells("auto", sm100="flashinfer_trtllm", sm103="flashinfer_trtllm",
                  sm120="flashinfer_cutlass", sm121="flashinfer_cutlass"),
            MOE_PATCH,
        )  # fmt: skip
    repo.commit("the fork", fork_files("0.5.9", patches, expectations))
    repo.git("checkout", "-q", "-b", "pr")
    return repo
