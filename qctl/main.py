"""qctl: the admin CLI of the quantize-and-serve stack."""

from __future__ import annotations

import typer

from qctl import deploy_cmd, jobs_cmd, rollout_cmd
from qctl.demo_cmd import demo
from qctl.eval_cmd import evaluate
from qctl.fallback_cmd import fallback
from qctl.generate_cmd import generate
from qctl.inspect_cmd import events, workers
from qctl.ls_cmd import ls
from qctl.publish_cmd import publish
from qctl.quantize_cmd import quantize
from qctl.up_cmd import up

# rich_markup_mode=None: help texts are plain text; rich markup read "[a-z0-9._-]" or "[default: ...]" in
# them as tags and dropped them. (Typer sets it per app, so deploy_cmd and rollout_cmd set it too.)
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="Quantize, publish, roll out and serve W4A8KV4 LLMs.")
app.command("quantize")(quantize)
app.command("eval")(evaluate)
app.command("demo")(demo)
app.command("publish")(publish)
app.command("ls")(ls)
app.add_typer(jobs_cmd.app, name="jobs")
app.add_typer(deploy_cmd.app, name="deploy")
app.add_typer(rollout_cmd.app, name="rollout")
app.command("fallback")(fallback)
app.command("workers")(workers)
app.command("events")(events)
app.command("generate")(generate)
app.command("up")(up)


if __name__ == "__main__":
    app()
