"""`python -m meshtrain`: the commands, each run as `python -m meshtrain.<command> [--help]`."""
import sys

COMMANDS = {
    "run": "train (the embedded default with no arguments; --help lists every config key)",
    "evaluate": "the held-out loss of a checkpoint",
    "generate": "sample continuations of prompts from a checkpoint",
    "export": "a checkpoint as a Hugging Face Llama directory",
    "inspect": "what a config compiles to: memory, collectives by phase, FLOPs",
    "plan": "search the layouts that fit a model on a machine",
    "schedule": "draw a pipeline schedule",
    "plot": "loss, throughput and memory curves of runs",
    "profile": "the time-by-category table of a device trace",
}


def main() -> int:
    print("meshtrain is a set of commands; run one as python -m meshtrain.<command> (--help for its options):\n")
    for name, what in COMMANDS.items():
        print(f"  python -m meshtrain.{name:<9} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
