"""Run configuration: one small frozen dataclass per component, named presets, YAML files, CLI overrides.

The command-line / YAML-file layer for entry points (``python -m llamarl.train``, benchmarks, tests) over
``llamarl.config`` (the dataclasses and their validation) and ``llamarl.presets`` (the named presets):
``add_config_args`` adds the flags to a parser, ``config_from_args`` turns the parsed flags into a
``TrainConfig``, ``load_config`` does both for a whole command line. The ``--help`` description and
epilog are written in ``load_config``.

Sources, lowest to highest precedence::

    PRESETS[--preset]  <  --config FILE.yaml  <  named flags (--out, --mode, ...)  <  --set section.key=value

The YAML file mirrors the dataclasses (``trainer: {lr: 3.0e-4}``); ``--set`` may repeat. Values given as
text (CLI, or YAML strings such as ``3e-4``) are parsed by the field's type.

Validation happens before any process starts, and every message starts with the field or flag it is about
("trainer.lr: must be > 0, got -1", "--set: expects SECTION.KEY=VALUE"): unknown presets, files, sections,
keys and options get a did-you-mean; the dataclasses check the values; ``load_config`` then calls
``TrainConfig.check_environment()`` (files and directories exist, CUDA is there when asked for, a
``module:function`` reward imports, ``--out`` is not an earlier run).

Mode and staleness: a config needs ``mode="sync"`` if and only if ``max_staleness == 0``. The one of the two
set at the higher level (command line over ``--config`` file over preset) decides the other (``--mode sync``
implies staleness 0, also over a file that says ``max_staleness: 1``; ``--max-staleness 0`` implies sync;
``--mode async`` keeps the staleness if >= 1, else 1). Setting both inconsistently at one level is an error.

Layout shorthand: ``run.layout`` / ``--layout`` ("trainer=2,generator=2x1,reward=2") sets the fields of the
items it names (``trainer.ranks``/``trainer.parallel``, ``generator.tp``/``generator.replicas``,
``reward.workers``, ``run.device``) unless they are given at the same level as well, in which case they must
agree; a field given at a higher level wins and drops the layout (``--set trainer.ranks=1`` on resuming a run
saved with a layout).
``--resume DIR`` continues the run DIR belongs to with that run's saved ``config.yaml`` in place of the
preset (its model, tokenizer, data, reward, ...: ``--config``, flags and ``--set`` still override it), in
that run directory unless ``--out`` names another, new one; ``--max-steps`` must exceed the step reached.
An empty or null ``--resume`` / ``--set run.resume=`` (``""``, ``none``, ``null``, ``~``: an unset shell
variable) is an error, not a fresh run.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Sequence

import yaml

from llamarl.config import REWARD_NAMES, TrainConfig, _build, _layout_fields, _merge
from llamarl.config_values import ConfigError, Text, coerce, did_you_mean, fail, is_null_text, unquote
from llamarl.presets import PRESETS
from llamarl.run_files import resume_file, resume_run_dir

# Named flags: flag -> (dotted field, help).
NAMED_FLAGS: dict[str, tuple[str, str]] = {
    "--out": ("run.out", "run directory: metrics.jsonl, summary.json, config.yaml, checkpoints/"),
    "--max-steps": ("run.max_steps", "RL steps to run"),
    "--mode": ("run.mode", "async (generators run ahead, bounded staleness) or sync (lock step)"),
    "--max-staleness": ("run.max_staleness", "policy versions a generator may run ahead (0 = sync)"),
    "--model": ("policy.model", "built-in model name or Hugging Face Llama directory"),
    "--dataset": ("data.dataset", "synthetic:NAME[:options] or a .jsonl/.parquet file"),
    "--eval-dataset": ("data.eval_dataset", "a .jsonl/.parquet file of held-out problems (default: drawn from "
                       "--dataset)"),
    "--reward": ("reward.reward", f"{'|'.join(REWARD_NAMES)}, module:function or file.py:function; none: "
                                  "reward.model alone"),
    "--resume": ("run.resume", "run (or checkpoint) directory to continue from"),
    "--layout": ("run.layout", "placement, e.g. trainer=2,generator=2x1,reward=2 (generator = TP x replicas)"),
    "--seed": ("run.seed", "random seed"),
    "--device": ("run.device", "auto, cpu or cuda"),
}


def add_config_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--preset``, ``--config``, ``--set`` and the named flags to ``parser`` (for entry points)."""
    parser.add_argument("--preset", default="default", help=f"named preset: {', '.join(PRESETS)}")
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file with sections as in TrainConfig")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one field, e.g. --set trainer.lr=3e-4 (repeatable; wins over all)")
    for flag, (dotted, help_text) in NAMED_FLAGS.items():
        parser.add_argument(flag, dest=_dest(flag), metavar=dotted.split(".")[1].upper(), help=help_text)
    return parser


def config_from_args(args: argparse.Namespace, *, check_environment: bool = True) -> TrainConfig:
    """The ``TrainConfig`` described by parsed ``add_config_args`` arguments (see module docstring)."""
    if args.preset not in PRESETS:
        fail("--preset", f"unknown preset{did_you_mean(args.preset, PRESETS)}; presets: {', '.join(PRESETS)}",
             args.preset)
    loaded = _load_yaml("--config", Path(args.config)) if args.config else {}
    overrides: list[tuple[str, str]] = []
    for flag, (dotted, _) in NAMED_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            overrides.append((dotted, value))
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key or not all(part.strip() for part in key.split(".", 1)):
            fail("--set", "expects SECTION.KEY=VALUE, e.g. --set trainer.lr=3e-4", item)
        # a string field keeps its spaces (a template's trailing one); "quoted" text is the string inside
        overrides.append((key.strip(), unquote(value)))
    for dotted, value in overrides:
        if dotted == "run.resume" and is_null_text(value):
            # e.g. --resume "$RUN" with RUN unset: a resume was asked for, not a fresh run in the cwd (or ./none)
            fail("run.resume", "must name a run or checkpoint directory to continue from (the command line gives "
                 "an empty or null value); pass that directory, or leave out --resume to start a new run", value)
    resume = next((v for d, v in reversed(overrides) if d == "run.resume"), None)
    if resume is None:
        run_section = loaded.get("run")  # (not a mapping: refused with the other sections' message below)
        resume = run_section.get("resume") if isinstance(run_section, dict) else None
        if isinstance(resume, str) and is_null_text(resume):  # YAML null (no resume) stays fine
            fail("run.resume", f"must name a run or checkpoint directory to continue from ({args.config} gives an "
                 "empty or null text); write the directory, or null (or leave the key out) to start a new run",
                 resume)
    base, saved = PRESETS[args.preset], resume_file(resume) if resume is not None else None
    if saved is not None:
        # a resumed run continues with its own settings (model, tokenizer, data, reward, ...), not the preset's
        base = saved_config(saved)
    data = base.to_dict()
    explicit: dict[str, int] = {}  # field -> the level that set it: FILE, or COMMAND_LINE (flags and --set)
    if loaded:
        data = _merge(data, _as_text(loaded), str(args.config))
        explicit |= {f"{s}.{k}": FILE for s, sec in loaded.items() for k in (sec or {})}
    for dotted, value in overrides:
        section, _, name = dotted.partition(".")
        data = _merge(data, {section: {name: Text(value)}}, "command line")
        explicit[dotted] = COMMAND_LINE
    _apply_layout_shorthand(data, explicit)
    _apply_mode_rule(data, explicit, base)
    run = data["run"]
    if run.get("resume") is not None and "run.out" not in explicit:
        run["out"] = str(resume_run_dir(run["resume"]))
    config = _build(data)
    if saved is not None:
        _check_same_policy(base, config, saved)
        _check_same_data(base, config, saved)
    if check_environment:
        config.check_environment()
    return config


def saved_config(path: Path) -> TrainConfig:
    """The configuration a run saved (its config.yaml), read as ``--config`` files are (``3e-4`` is a number;
    keys it lacks take today's defaults); raises ``ConfigError``."""
    return _build(_merge(TrainConfig().to_dict(), _as_text(_load_yaml("run.resume", path)), str(path)))


def _check_same_policy(saved_cfg: TrainConfig, cfg: TrainConfig, saved: Path) -> None:
    """A resumed run keeps the model and tokenizer it started with: its checkpoints hold that model's
    weights, and another tokenizer would silently mean other tokens. A new path is accepted only where the
    saved one no longer exists (the files moved; llamarl.train then checks the model's shapes against the
    checkpoint's)."""
    for name in ("model", "tokenizer"):
        old, new = getattr(saved_cfg.policy, name), getattr(cfg.policy, name)
        if old == new or (old is not None and new is not None and Path(old).exists() and Path(new).exists()
                          and Path(old).resolve() == Path(new).resolve()):
            continue
        from llamarl.models.config import LLAMA_CONFIGS

        if old is None or old in LLAMA_CONFIGS or Path(old).exists():
            fail(f"policy.{name}", f"the resumed run started with policy.{name}={old!r} ({saved}) and continues "
                 f"with it; drop the override (to train another model from this run's weights, start a new run "
                 f"with --model <checkpoint>/policy)", new)


# what fixes a run's data stream: its held-out split, its few-shot examples and the order of its training
# prompts (the checkpoint's data position counts into that order); llamarl.train also compares the stream
# itself with the checkpoint's (TrainData.stream_id: an edited file, prompts dropped by another max_new_tokens)
_DATA_STREAM = ("run.seed", "data.dataset", "data.eval_dataset", "data.eval_size", "data.few_shot", "data.template",
                "data.chat", "data.system", "data.prompt_field", "data.answer_field", "data.id_field")
_DATA_FILES = ("data.dataset", "data.eval_dataset")


def _check_same_data(saved_cfg: TrainConfig, cfg: TrainConfig, saved: Path) -> None:
    """A resumed run keeps its data stream: with another seed, held-out size, dataset or prompt format the
    checkpoint's data position would point into another order, and the held-out problems could be ones the
    run trained on. A moved dataset file (the saved path no longer exists) is accepted, as for the model; a training
    file whose records have no id field keeps its name (their ids are "<file stem>-<index>", which llamarl.train's
    stream check compares; an eval file's held-out samples are compared by content)."""
    for dotted in _DATA_STREAM:
        section, _, name = dotted.partition(".")
        old, new = getattr(getattr(saved_cfg, section), name), getattr(getattr(cfg, section), name)
        moved_file = dotted in _DATA_FILES and old is not None and new is not None \
            and not old.startswith("synthetic:") and (not Path(old).exists() or _same_file(old, new))
        if old == new or moved_file:
            continue
        fail(dotted, f"the resumed run started with {dotted}={old!r} ({saved}); its held-out split and the data "
             "position of its checkpoints depend on it, so a resume keeps it: drop the override, or start a new run "
             "from the checkpoint's weights (--model <checkpoint>/policy)", new)


def _same_file(a: str, b: str) -> bool:
    """Do two path spellings (the saved config's absolute one, a relative one on the command line) name one file?"""
    return Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()


def load_config(argv: Sequence[str] | None = None, *, check_environment: bool = True) -> TrainConfig:
    """Parse a command line (``sys.argv[1:]`` if None) into a validated ``TrainConfig``."""
    parser = add_config_args(argparse.ArgumentParser(
        prog="llamarl.train", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Asynchronous AIPO reinforcement learning of a Llama policy (LlamaRL). Without arguments: the\n"
                    "embedded default (--preset default), the built-in tiny Llama on built-in arithmetic, on the CPU.",
        epilog="Every field of every section can be set with --set SECTION.KEY=VALUE; a run's config.yaml lists\n"
               "them all, llamarl/config_sections.py documents them. Exit status: 0 done, 2 bad configuration\n"
               "(nothing started), 1 an executor failed or hung, or the reward function or its workers failed,\n"
               "130 Ctrl-C, 143 SIGTERM (the last checkpoint stays intact)."))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        split = [item for item in args.overrides if "=" not in item]
        if split and not unknown[0].startswith("-"):  # --set trainer.lr 3e-4: a space where '=' belongs
            fail("--set", f"expects SECTION.KEY=VALUE, e.g. --set {split[0]}={unknown[0]} (one argument, joined by "
                 "'=')", split[0])
        flag = unknown[0].split("=")[0]
        flags = [a for action in parser._actions for a in action.option_strings]
        fail(flag, f"unknown option{did_you_mean(flag, flags)}; see --help")
    return config_from_args(args, check_environment=check_environment)


# -------------------------------------------------------------------- internals
class _ConfigLoader(yaml.SafeLoader):
    """YAML as a config file needs it: a key given twice in one mapping is an error (the later one would
    silently replace the earlier: a second ``trainer:`` section drops the first's fields), and integers are
    decimal or 0x hex only (YAML 1.1 reads ``0042`` as octal 34 and ``1:30`` as 90; here they are text, so
    ``seed: 0042`` is 42 and ``1:30`` is refused by the field)."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool, type(None))):  # unhashable: the base class reports it
                continue
            if key in lines:  # (also two on one line: {lr: 1, lr: 2})
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (lines {lines[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); the second would silently replace the first: keep one",
                    key_node.start_mark)
            lines[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int",
                                    re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(  # YAML 1.1's floats without the base-60 ones
    "tag:yaml.org,2002:float", re.compile(r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*"
                                          r"(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _load_yaml(field: str, path: Path) -> dict:
    if not path.exists():
        fail(field, "no such file", str(path))
    if path.is_dir():
        fail(field, "is a directory; give the YAML file (a run's settings are in RUN_DIR/config.yaml)", str(path))
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader) or {}
    except UnicodeDecodeError as exc:
        fail(field, f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as UTF-8")
    except OSError as exc:
        fail(field, f"cannot read {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        fail(field, f"{path} is not valid YAML: {exc}")
    if not isinstance(loaded, dict):
        fail(field, f"{path} must hold a mapping of sections (policy:, trainer:, ...)")
    return loaded


def _as_text(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _as_text(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_text(v) for v in obj]
    return Text(obj) if isinstance(obj, str) else obj


def _dest(flag: str) -> str:
    return "flag_" + flag.lstrip("-").replace("-", "_")


FILE, COMMAND_LINE = 1, 2  # the levels a field can be set at above the preset (or a resumed run's config): 0


def _apply_layout_shorthand(data: dict, explicit: dict[str, int]) -> None:
    """The layout sets the fields it names that were set at a lower level than itself (a file's fields under
    --layout, the preset's under a file's layout); a field set at a higher level (--set trainer.ranks=2 over
    a resumed run's saved layout) wins, and the layout, which no longer describes the run, is dropped. Both
    at one level must agree (TrainConfig checks)."""
    spec = data["run"].get("layout")
    if spec is None or (isinstance(spec, str) and is_null_text(spec)):  # --set run.layout=null drops a layout
        data["run"]["layout"] = None
        return
    if not isinstance(spec, str):
        fail("run.layout", "must be a string like 'trainer=2,generator=2x1,reward=2'", spec)
    level = explicit.get("run.layout", 0)
    fields = _layout_fields(spec)
    for key, value in fields.items():
        if explicit.get(key, 0) < level:
            section, name = key.split(".")
            data[section][name] = value
    if any(explicit.get(key, 0) > level for key in fields):
        data["run"]["layout"] = None


def _apply_mode_rule(data: dict, explicit: dict[str, int], preset: TrainConfig) -> None:
    """Of run.mode and run.max_staleness, the one set at the higher level decides the other (--mode sync over
    a file's max_staleness: 1 gives staleness 0); set at one level, both stand and must agree."""
    run = data["run"]
    mode_level, stale_level = explicit.get("run.mode", 0), explicit.get("run.max_staleness", 0)
    try:
        stale = coerce("run.max_staleness", _as_text(run["max_staleness"]), int)
    except ConfigError:
        stale = None  # the type check reports it with the field name
    if mode_level > stale_level:
        mode = str(run["mode"]).strip()  # (the field's own parsing strips it too)
        keep = stale if stale_level and stale is not None and stale >= 1 else preset.run.max_staleness
        run["max_staleness"] = 0 if mode == "sync" else max(1, keep)
    elif stale_level > mode_level and stale is not None:
        run["mode"] = "sync" if stale == 0 else "async"
