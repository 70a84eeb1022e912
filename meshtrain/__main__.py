"""`meshtrain <command> [args]` (the installed console script) and `python -m meshtrain <command> [args]`: the
same as `python -m meshtrain.<command> [args]`. Without a command, the list of commands.
"""
import runpy
import sys

COMMANDS = {
    "run": "train (the embedded default with no arguments; --help lists every config key)",
    "evaluate": "the held-out loss of a checkpoint",
    "generate": "sample continuations of prompts from a checkpoint",
    "export": "a checkpoint as a Hugging Face directory (Llama, OLMoE, Mixtral)",
    "inspect": "what a config compiles to: memory, collectives by phase, FLOPs",
    "plan": "search the layouts that fit a model on a machine",
    "schedule": "draw a pipeline schedule",
    "plot": "loss, throughput and memory curves of runs",
    "profile": "the time-by-category table of a device trace",
}


def usage(file=sys.stdout) -> None:
    print("meshtrain is a set of commands; run one as `meshtrain <command>` or `python -m meshtrain.<command>` "
          "(--help for its options):\n", file=file)
    for name, what in COMMANDS.items():
        print(f"  meshtrain {name:<9} {what}", file=file)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        usage()
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"meshtrain: unknown command {name!r}\n", file=sys.stderr)
        usage(sys.stderr)
        return 2
    # The command's module runs as its own __main__, exactly as `python -m meshtrain.<command>` runs it (its
    # start-up, e.g. the signal handlers taken before jax starts, included); nothing here imports jax first.
    sys.argv = [f"meshtrain {name}", *rest]
    runpy.run_module(f"meshtrain.{name}", run_name="__main__")
    return 0  # a command that returns instead of exiting succeeded


if __name__ == "__main__":
    sys.exit(main())
