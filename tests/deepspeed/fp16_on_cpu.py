"""The DeepSpeed harness with fp16 allowed on a CPU, for finding what fp16 checkpoints hold.

DeepSpeed 0.19.8's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels (these machines'
do not: "Type fp16 is not supported on your device"); torch's own CPU kernels run fp16 all the
same. Only ``test_deepspeed_classes.py`` uses this, to list the classes DeepSpeed puts in an fp16
checkpoint (its dynamic loss scaler); the numbers such a run produces are not compared with anything.
"""

import sys

from deepspeed.accelerator import get_accelerator

get_accelerator().is_fp16_supported = lambda: True

from megatron_ext.testing import deepspeed_harness  # noqa: E402

if __name__ == "__main__":
    sys.exit(deepspeed_harness.main())
