"""Several command lines of one toolkit command, run in one process as if each were its own.

    python tests/helpers/cli_batch.py tpu_keras.plan '{"NAME": [ARG, ...], ...}'

Each call gets freshly parsed flags and its own stdout and stderr, and ends
where its process would end (`sys.exit`, `main` returning, or `cli.exit_at_once`,
which here ends the call instead of the process). Prints one line per call,
`CALL {"name", "code", "stdout", "stderr"}`. One start of TensorFlow and JAX
then serves many calls of a command that keeps no state between them (`plan`,
`layout`, `generate`), or many mistakes of one that does (`train` refusing
bad input). A call that trains or picks another engine needs a process of its
own; calls that fix the device count (`--config.cluster.virtual_devices`,
`plan --measure --compiler=cpu`) share one only where they all ask for the same.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import contextlib  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from absl import flags  # noqa: E402

from tpu_keras import cli  # noqa: E402


def _end_the_call(code):
    raise SystemExit(code)


cli.exit_at_once = _end_the_call  # `cli.fail(..., at_once=True)` ends this call, not the process
command = importlib.import_module(sys.argv[1])
calls = json.loads(sys.argv[2])
for name, args in calls.items():
    flags.FLAGS.unparse_flags()
    for flag in [f for f in flags.FLAGS if f.startswith("config.")]:
        delattr(flags.FLAGS, flag)  # ml_collections defines each override flag as it parses
    sys.argv = [command.__file__, *args]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.start(command.main)
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else int(done.code is not None)
    print("CALL " + json.dumps({"name": name, "code": code, "stdout": out.getvalue(),
                                "stderr": err.getvalue()}), flush=True)
