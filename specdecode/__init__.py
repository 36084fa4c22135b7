"""specdecode: lossless speculative decoding for Hugging Face causal LMs."""

from specdecode.api import SpecDecode, load
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError

__all__ = ["SamplingParams", "SpecDecode", "SpecDecodeError", "load"]
__version__ = "0.1.0"
