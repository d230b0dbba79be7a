"""train.py's reward flags (in the "PODS / GRPO" group; run/config.py assembles the parser): the registered reward
terms' weights and options (rewards.REWARD_TERMS), reward functions of one's own (FILE.py:NAME[=WEIGHT], called as
TRL's GRPOTrainer calls them) and their time limit. Parsed into what config.json records (`resolve_defaults`,
`own_functions`), checked (`check_values`, `check_functions`) and at a resume against what the run recorded
(`check_reward_terms`, `check_reward_functions`); `reward_settings`, the rewards.RewardSettings of them."""

import json
import math
from pathlib import Path

import data
from grading import trl_call
import rewards

DEFAULT_REWARD_WEIGHTS = ",".join(f"{name}={weight:g}" for name, weight in rewards.DEFAULT_REWARD_WEIGHTS.items())
NON_NEGATIVE = ("reward_function_timeout_s",)


def add_flags(group):
    """The reward flags, in --help's order."""
    add = group.add_argument
    add("--reward-weights", default="",
        help=f"name=weight for the reward terms whose weight changes; the others keep theirs "
             f"({DEFAULT_REWARD_WEIGHTS}, the paper's; weight 0 logs a reward without training on it)")
    add("--reward-options", default="",
        help="term.option=value,... for the reward terms with options of their own (rewards.REWARD_TERMS)")
    add("--reward-function", action="append", default=[], metavar="FILE.py:NAME[=WEIGHT]",
        help="a reward function of your own, called as TRL's GRPOTrainer calls it (prompts, completions as assistant "
             "messages, completion_ids, every dataset column, trainer_state, log_extra, log_metric, by keyword; "
             "returns a number or None per completion), weight 1 unless given; repeatable (default: none)")
    add("--reward-function-timeout-s", type=float, default=trl_call.DEFAULT_TIMEOUT_S,
        help="seconds one call of a --reward-function function may take (it scores a rollout batch); past it the run "
             "stops in one line naming the function; 0 = no limit")


def resolve_defaults(args):
    """The reward weights and options parsed, once, into dicts (every registered term's weight), every term's resolved
    weight and options (`reward_terms`, recorded in config.json), each --reward-function spec once."""
    args.reward_weights = parse_reward_weights(args.reward_weights)
    args.reward_options = parse_reward_options(args.reward_options)
    args.reward_terms = reward_terms(args.reward_weights, args.reward_options)  # recorded in config.json
    args.reward_function = list(dict.fromkeys(args.reward_function or []))  # a resume given its specs again


def reward_terms(weights, options):
    """{term: {"weight", "options"}} of every registered reward term, resolved (its options' defaults included):
    what config.json records, so that a resume sees a term registered, or an option's default changed, since."""
    return {name: {"weight": weights[name], "options": {**term.options, **options.get(name, {})}}
            for name, term in rewards.REWARD_TERMS.items()}


def parse_reward_weights(spec):
    """"format=0.1" (or the dict a config.json holds) -> {name: weight} of every registered reward term: the named
    ones changed, the others at their default weight (rewards.DEFAULT_REWARD_WEIGHTS). An unknown name is an error."""
    weights = dict(rewards.DEFAULT_REWARD_WEIGHTS)
    items = spec.items() if isinstance(spec, dict) else (item.partition("=")[::2] for item in spec.split(",") if item)
    for name, value in items:
        name = name.strip()
        if name not in rewards.REWARD_FUNCS:
            raise ValueError(f"unknown reward function {name!r} in --reward-weights; "
                             f"expected names from {sorted(rewards.REWARD_FUNCS)}")
        try:
            weights[name] = float(value) if value != "" else 1.0
        except (TypeError, ValueError):
            raise ValueError(f"--reward-weights: weight of {name!r} is not a number: {value!r}") from None
        if not math.isfinite(weights[name]):  # nan or inf would reach the loss and config.json
            raise ValueError(f"--reward-weights: weight of {name!r} is not a number: {value!r} (it must be finite)")
    return weights


def parse_reward_options(spec):
    """"term.option=value,..." (or the dict a config.json holds) -> {term: {option: value}}, each value of its
    default's type; an unknown term or option, or a value of the wrong type, is an error."""
    items = ((f"{term}.{key}", value) for term, given in spec.items() for key, value in given.items()) \
        if isinstance(spec, dict) else (item.partition("=")[::2] for item in spec.split(",") if item)
    options = {}
    for key, value in items:
        term, _, option = key.strip().partition(".")
        known = rewards.REWARD_TERMS[term].options if term in rewards.REWARD_TERMS else {}
        if option not in known:
            raise ValueError(f"--reward-options: no option {key.strip()!r}; reward terms' options: "
                             f"{[f'{t.name}.{o}' for t in rewards.REWARD_TERMS.values() for o in t.options]}")
        kind = type(known[option])
        try:
            parsed = {"true": True, "false": False}[str(value).lower()] if kind is bool else value
            options.setdefault(term, {})[option] = kind(parsed)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"--reward-options: {key.strip()} needs a {kind.__name__}, got {value!r}") from None
    return options


def check_values(args):
    """Every --reward-function spec well formed and its file there."""
    for spec in args.reward_function:
        path, name, _ = parse_reward_function(spec)
        if not Path(path).is_file():
            raise FileNotFoundError(f"--reward-function {spec!r}: file not found: {path}")


def check_functions(args):
    """Every --reward-function function loaded (its file imported), no two of one name."""
    names = [load_reward_function(spec).name for spec in args.reward_function]  # imports each file
    if len(set(names)) < len(names):
        raise ValueError(f"--reward-function: two functions named {[n for n in names if names.count(n) > 1][0]!r}")


def own_functions(args):
    """config.json's `reward_functions`: {name: {"path", "sha256", "weight"}} of --reward-function, so that a resume
    refuses a changed one. A file not there is left out here: the checks refuse it."""
    functions = {}
    for spec in args.reward_function:
        try:
            path, name, weight = parse_reward_function(spec)
        except ValueError:
            continue  # refused by check_values
        if Path(path).is_file():
            functions[name] = {"path": str(Path(path).resolve()), "sha256": data.file_sha256(path), "weight": weight}
    return functions


def reward_settings(args):
    """The rewards.RewardSettings of the flags: the registered terms' weights and options, --prefill-think,
    --answer-kind, the --reward-function functions (loaded), their time limit, and for them a TRL trainer_state of
    the run's --max-steps (train.py keeps its step and epoch current)."""
    functions = tuple(load_reward_function(spec) for spec in args.reward_function or [])
    return rewards.RewardSettings(args.reward_weights, args.reward_options, args.prefill_think, args.answer_kind,
                                  functions, args.reward_function_timeout_s,
                                  trl_call.trainer_state(max_steps=args.max_steps) if functions else None)


def check_reward_terms(args, saved):
    """A resume's reward terms against those its run recorded (config.json "reward_terms"; older runs: the terms of
    their resolved "reward_weights"): a term registered since, with a weight, or a recorded term's option whose value
    is now another (a changed default), is refused in one ValueError line naming the flag that keeps the run as it
    was. Weights given anew are refused with the other flags (runfolder.resume_changes)."""
    recorded = saved.get("reward_terms")
    if recorded is None and isinstance(saved.get("reward_weights"), dict):
        recorded = {name: {"weight": weight} for name, weight in saved["reward_weights"].items()}
    if not isinstance(recorded, dict):
        return  # the run's terms are unknown: its weights are compared as parsed now
    unknown = [name for name, term in recorded.items() if name not in args.reward_terms and term.get("weight")]
    if unknown:
        raise ValueError(f"--resume: the run in {args.output_dir} trained on reward terms {unknown}, which are no "
                         "longer registered (rewards.REWARD_TERMS); it cannot continue as it is")
    new = [name for name, term in args.reward_terms.items() if name not in recorded and term["weight"] != 0]
    if new:
        zero = ",".join(f"{name}=0" for name in new)
        raise ValueError(f"--resume: reward terms {new} did not exist when the run in {args.output_dir} started; "
                         f"continue it without them (--reward-weights {zero}) or start a new run in another "
                         "--output-dir")
    changed = [(name, option, value, args.reward_terms[name]["options"].get(option))
               for name, term in recorded.items() if name in args.reward_terms
               for option, value in term.get("options", {}).items()
               if args.reward_terms[name]["options"].get(option) != value]
    if changed:
        given = ",".join(f"{name}.{option}={value}" for name, option, value, _ in changed)
        now = ", ".join(f"{name}.{option} {value!r} -> {current!r}" for name, option, value, current in changed)
        raise ValueError(f"--resume: reward options differ from those the run in {args.output_dir} started with "
                         f"({now}); continue it with --reward-options {given} or start a new run in another "
                         "--output-dir")


def check_reward_functions(args, saved):
    """A resume trains on the functions of one's own its run started with, unchanged (name, file SHA-256, weight)."""
    recorded, now = saved.get("reward_functions") or {}, args.reward_functions
    if json.dumps(recorded, sort_keys=True) == json.dumps(now, sort_keys=True):
        return
    changed = sorted(name for name in set(recorded) | set(now) if recorded.get(name) != now.get(name))
    said = "; ".join(f"{name}: {_reward_function_said(recorded.get(name))} -> {_reward_function_said(now.get(name))}"
                     for name in changed)
    raise ValueError(f"--resume: the run in {args.output_dir} started with other --reward-function functions ({said}); "
                     "restore them or start a new run in another --output-dir")


def _reward_function_said(entry):
    return "absent" if not entry else f"{Path(entry['path']).name} sha256 {entry['sha256'][:12]} weight {entry['weight']:g}"


def saved_as_parsed(args, saved):
    """The resumed run's recorded weights and options as this version parses them (older runs saved the flags' text)."""
    weights = saved["reward_weights"]  # older runs saved the flag's text: the terms then unknown, parsed now
    saved["reward_weights"] = parse_reward_weights(weights) if isinstance(weights, str) else \
        {**{name: 0.0 for name in args.reward_weights}, **weights}  # a term the run did not record weighed 0
    if isinstance(saved["reward_options"], str):
        saved["reward_options"] = parse_reward_options(saved["reward_options"])


# ------------------------------------------------------------------ --reward-function FILE.py:NAME[=WEIGHT]

def parse_reward_function(spec):
    """"FILE.py:NAME[=WEIGHT]" -> (path, name, weight); a malformed spec is one ValueError line."""
    where, _, weight = spec.rpartition("=") if "=" in spec.rpartition(":")[2] else (spec, "", "")
    path, _, name = where.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"--reward-function {spec!r}: expected FILE.py:NAME or FILE.py:NAME=WEIGHT")
    try:
        value = float(weight) if weight else 1.0
    except ValueError:
        raise ValueError(f"--reward-function {spec!r}: the weight {weight!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"--reward-function {spec!r}: the weight must be finite")
    return path, name, value


_REWARD_FILES = {}  # (resolved path, SHA-256) -> its module: a file is imported once per process


def load_reward_function(spec):
    """The OwnReward of a --reward-function spec: the file imported (once per process and content), NAME a function
    taking **kwargs (it receives every dataset column by name). Everything wrong is one ValueError line naming the
    spec."""
    import hashlib
    import importlib.util
    import inspect
    from pathlib import Path

    path, name, weight = parse_reward_function(spec)
    if not Path(path).is_file():
        raise ValueError(f"--reward-function {spec!r}: file not found: {path}")
    if name in rewards.REWARD_TERMS:
        raise ValueError(f"--reward-function {spec!r}: {name!r} is a registered reward term; name yours otherwise "
                         "(--reward-weights changes a registered term's weight)")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    key = (str(Path(path).resolve()), digest)
    if key not in _REWARD_FILES:
        module_spec = importlib.util.spec_from_file_location(f"reward_file_{Path(path).stem}_{digest[:8]}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as error:  # noqa: BLE001  the user's file: one line, whatever it raised
            raise ValueError(f"--reward-function {spec!r}: importing {path} raised {type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''}") from None
        _REWARD_FILES[key] = module
    module = _REWARD_FILES[key]
    func = getattr(module, name, None)
    if not callable(func):
        found = sorted(key for key, value in vars(module).items() if inspect.isfunction(value))
        raise ValueError(f"--reward-function {spec!r}: {path} has no function {name!r} (functions: {found})")
    kinds = [parameter.kind for parameter in inspect.signature(func).parameters.values()]
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        raise ValueError(f"--reward-function {spec!r}: {name} must take **kwargs, as TRL's reward functions do "
                         "(it is called with prompts, completions, completion_ids and every dataset column by name)")
    return rewards.OwnReward(name, func, weight, str(Path(path).resolve()), digest)


def recorded_reward_functions(run_config):
    """(the OwnRewards a run's config.json records, loaded, and a line for each it cannot load as the run trained
    with it: its file gone or changed since, SHA-256). eval.py's reward report."""
    loaded, notes = [], []
    for name, entry in (run_config.get("reward_functions") or {}).items():
        path = Path(entry["path"])
        problem = "is gone" if not path.is_file() else "changed since the run trained with it (SHA-256)" \
            if data.file_sha256(path) != entry["sha256"] else None
        if problem:
            notes.append(f"the run's reward function {name!r}: {path} {problem}; it is left out of the reward report")
        else:
            loaded.append(load_reward_function(f"{path}:{name}={entry['weight']}"))
    return loaded, notes
