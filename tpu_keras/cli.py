"""The one command-line path every entry point shares.

`start(main)` is `absl.app.run(main)` with one way to fail: a mistake in the
flags, the config file, the config overrides or the environment ends as
one `error: ...` line that says what to change, and exit code 2 (with
`--verbose`, the traceback above it). The facts in those lines come from
the config and from absl's own parsers, never from the wording of another
library's error message:

- a config file is loaded here first, so an exception it raises is reported
  with its file and line, and a value of the wrong type with the key and
  both types (the file is loaded once more without type checks to find the
  key);
- each `--config.KEY=VALUE` is checked against the loaded config before
  ml_collections applies it: the key must exist (else the closest one is
  named) and the value must parse as the key's type; a `model.*` key the file
  does not set is added (any builder argument; the builder checks the name).
"""

# Imported inside functions: JAX (optional: absent on a plain install; the tf engine runs
# without JAX).
import ast
import functools
import importlib.util
import logging as std_logging
import os
import sys
import traceback

from absl import app, flags, logging
import ml_collections

from tpu_keras import config as config_lib, data_section
from tpu_keras import lean_imports
from tpu_keras.errors import UserError, closest, first_line

_VERBOSE = flags.DEFINE_boolean("verbose", False, "On a mistake in the config, flags or "
                                "environment, print the traceback above the one-line error.")
EXIT_CODE = 2  # a mistake the user can fix


def start(main) -> None:
    """`app.run(main)`; a `UserError` from parsing or from `main` is one line and exit 2."""
    lean_imports.install()
    app.run(functools.partial(_main_or_fail, main), flags_parser=_parse_or_fail)


def fail(message, *, at_once: bool = False):
    """Ends the process with one `error: ...` line (the traceback first with --verbose)."""
    if sys.exc_info()[0] is not None and _verbose():
        traceback.print_exc()
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)  # one line, always
    if at_once:
        exit_at_once(EXIT_CODE)
    sys.exit(EXIT_CODE)


def exit_at_once(code: int):
    """Ends a process that got as far as training, without the interpreter's teardown.

    Everything a run writes is written and flushed by then; what is left to
    tear down (input iterators whose deletion can wait for up to a minute on
    the tf.data autotuner, see `data.iterator_reaper`) is not worth waiting
    for. A multi-process jax run first leaves its coordinator cleanly.
    """
    if code == 0 and "jax" in sys.modules:
        import jax
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def own_info_only() -> None:
    """Keeps the log readable: INFO lines from tpu_keras, warnings from everyone."""
    logging.get_absl_handler().python_handler.addFilter(
        lambda record: record.levelno >= std_logging.WARNING or "tpu_keras" in record.pathname)


def _main_or_fail(main, argv):
    try:
        return main(argv)
    except UserError as error:
        fail(error)


def _parse_or_fail(argv):
    try:
        new_model_keys = {}
        if "config" in flags.FLAGS:
            spec = _config_spec(argv[1:])
            if spec:
                config = load_config(spec)
                _check_overrides(config, argv[1:])
                argv, new_model_keys = _split_new_model_keys(config, argv)
        if new_model_keys:  # ml_collections finds override flags in sys.argv itself
            sys.argv = [arg for arg in sys.argv if arg in argv]
        rest = flags.FLAGS(argv)
        if new_model_keys:
            config = flags.FLAGS["config"].value
            with config.unlocked():
                config.model.update(new_model_keys)
        return rest
    except UserError as error:
        fail(error)
    except flags.Error as error:  # absl refused a flag itself; its first line says which
        fail(f"{first_line(error, 1000)}; run with --help to see the flags")


def _config_spec(args) -> str:
    """The FILE[:ARG] of `--config`, as the command line gives it ('' when it does not)."""
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
    return ""


def load_config(spec: str) -> ml_collections.ConfigDict:
    """The config `--config=FILE[:ARG]` gives: `get_config(ARG)` of FILE, or a one-line error."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise UserError(f"cannot load --config={spec}: {path} is not a file; give a config file "
                        "such as configs/lm_stdlib.py[:variant]")
    try:
        return _get_config(path, arg)
    except Exception as error:  # whatever the config file's own code raised
        where = _where(error, path)
        if isinstance(error, TypeError):  # a value of the wrong type for its key?
            with config_lib.without_type_checks():
                try:
                    config_lib.check_types(_get_config(path, arg))
                except UserError as wrong_type:
                    raise UserError(f"cannot load --config={spec}: {wrong_type} ({where or path})") from None
                except Exception:  # pylint: disable=broad-except  # not a type mistake after all
                    pass
        reason = f"{type(error).__name__}: {error}"
        raise UserError(f"cannot load --config={spec}: {where + ': ' if where else ''}{reason}") from None


def _get_config(path: str, arg: str):
    spec = importlib.util.spec_from_file_location("tpu_keras_user_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _where(error, path: str) -> str:
    """'FILE, line N' of the innermost frame of `error` in the config file, or ''."""
    if isinstance(error, SyntaxError):
        return ""  # its message already names the file and line
    target = os.path.abspath(path)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == target]
    return f"{path}, line {frames[-1].lineno}" if frames else ""


def _check_overrides(config, args) -> None:
    """Each `--config.KEY=VALUE` names a key of `config` and a value of its type."""
    for arg in args:
        if not arg.startswith("--config.") or "=" not in arg:
            continue  # `--config.KEY VALUE` is left to absl
        key, value = arg[len("--config."):].split("=", 1)
        if _is_new_model_key(config, key):
            continue  # a builder argument the file does not set: the builder checks it
        if key in config_lib.MOVED_KEYS:
            raise UserError(f"--config.{key} moved to --config.{config_lib.MOVED_KEYS[key]} (its "
                            "objective's section)")
        current = config
        for part in key.split("."):
            if not isinstance(current, ml_collections.ConfigDict) or part not in current:
                if key.startswith(f"data.{part}") and data_section.moved(part):  # a flat key of before
                    raise UserError(f"--config.{key}: {data_section.moved(part)}")
                known = list(current.keys()) if isinstance(current, ml_collections.ConfigDict) else []
                raise UserError(f"unknown config key in --config.{key}" + (
                    closest(part, known) or " (tpu_keras.config.defaults() lists every key; "
                    "model.* are the model builder's arguments)"))
            current = current[part]
        _check_value(key, value, current)


def _is_new_model_key(config, key: str) -> bool:
    """`model.NAME` that the config file does not set: any builder argument may be given."""
    parts = key.split(".")
    return (len(parts) == 2 and parts[0] == "model" and "model" in config
            and parts[1] not in config.model)


def _split_new_model_keys(config, argv):
    """(argv without the `--config.model.NAME=VALUE` the file does not set, {NAME: value}):
    ml_collections only overrides keys that exist, so these are set after parsing. A value
    is a Python literal where it parses as one (4, 0.1, True), else the string itself."""
    kept, new = [], {}
    for arg in argv:
        key, _, value = arg[len("--config."):].partition("=")
        if arg.startswith("--config.") and "=" in arg and _is_new_model_key(config, key):
            try:
                new[key.split(".")[1]] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                new[key.split(".")[1]] = value
        else:
            kept.append(arg)
    return kept, new


def _check_value(key: str, value: str, current) -> None:
    """A one-line error unless `value` parses as the type of `current`, as ml_collections parses it."""
    if isinstance(current, ml_collections.ConfigDict):
        if key.startswith("data.") and data_section.moved(key[len("data."):]):
            raise UserError(f"--config.{key}={value}: {data_section.moved(key[len('data.'):])}")
        keys = ", ".join(f"--config.{key}.{k}" for k in current.keys())
        raise UserError(f"--config.{key}={value}: {key} is a section, not a value; set "
                        + (f"its keys ({keys}) or " if keys else "") + "it in a config file")
    parsers = {bool: flags.BooleanParser(), int: flags.IntegerParser(), float: flags.FloatParser()}
    kind = type(current)
    try:
        if kind in parsers:
            parsers[kind].parse(value)
        elif kind in (tuple, list):
            if not isinstance(ast.literal_eval(value), (tuple, list)):
                raise ValueError(value)
    except (ValueError, SyntaxError):
        wanted = "true or false" if kind is bool else config_lib.a_type(kind)
        example = "" if kind is bool else f" such as {current!r}"
        raise UserError(f"--config.{key}={value} is not {wanted}; set {key} to {wanted}{example}") from None


def _verbose() -> bool:
    """--verbose, read from the command line itself when flag parsing has not happened yet."""
    if flags.FLAGS.is_parsed():
        return _VERBOSE.value
    given = [a.lower() for a in sys.argv[1:] if a.lower().split("=")[0] in ("--verbose", "--noverbose")]
    return bool(given) and given[-1] in ("--verbose", "--verbose=true", "--verbose=1")
