"""The conformance checks' names and one-line meanings, without importing torch: what
``modbench methods check --help`` and the command's argument checks read before the kit
(:mod:`modbench.conformance.kit`, which imports torch) is imported."""

from __future__ import annotations

#: every check, in the order they run (cheap first)
CHECKS = ("entry", "options", "conflicts", "params", "forward", "flops", "init", "causal",
          "gradients", "state_dict", "trains", "determinism", "compile", "export")
#: the checks that take seconds per method rather than fractions of one
SLOW_CHECKS = ("compile", "export")
#: one line per check: what it compares (docs/methods.md's table says the same at length)
DESCRIPTIONS = {
    "entry": "registry entry: name, category, citation, summary; docstring with Citation, Init",
    "options": "Options: a dataclass of typed, defaulted scalars; each value parses back",
    "conflicts": "slots filled under its own name; a second filler of one is refused, naming "
                 "both",
    "params": "built model's parameters = baseline + extra_params (two shapes, and with the "
              "neighbour)",
    "forward": "finite logits of the right shape, in training and evaluation mode",
    "flops": "extra_flops against torch's FLOP counter (forward 2 %, training 4 %)",
    "init": "starts_as_baseline: the baseline's logits at init, same seed",
    "causal": "a later token never changes an earlier position's logits",
    "gradients": "every parameter gets a finite gradient",
    "state_dict": "save, load into a fresh build: the same logits",
    "trains": "30 steps: finite losses, train and validation loss drop",
    "determinism": "two identical short runs: identical losses",
    "compile": "torch.compile: one graph, or only the declared graph breaks",
    "export": "Hugging Face export of the trained run: the same logits",
}
#: built-in methods tried, in order, as the neighbour a method is also checked with: the first
#: that fills none of the method's exclusive slots and composes with it
NEIGHBOURS = ("qknorm", "geglu", "layerscale", "softcap", "ssmax")


def describe_checks() -> str:
    """The checks, one line each."""
    return "\n".join(f"{name}{' (slow)' if name in SLOW_CHECKS else ''}: {DESCRIPTIONS[name]}"
                     for name in CHECKS)
