"""qctl: the admin CLI of the quantize-and-serve stack."""

from __future__ import annotations

import typer

from qctl.demo_cmd import demo
from qctl.eval_cmd import evaluate
from qctl.ls_cmd import ls
from qctl.publish_cmd import publish
from qctl.quantize_cmd import quantize

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Quantize, publish, roll out and serve W4A8KV4 LLMs.")
app.command("quantize")(quantize)
app.command("eval")(evaluate)
app.command("demo")(demo)
app.command("publish")(publish)
app.command("ls")(ls)


if __name__ == "__main__":
    app()
