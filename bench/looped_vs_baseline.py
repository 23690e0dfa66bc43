"""Wall-clock against the FLOPs match for a budget-matched baseline / SMELT pair."""

import sys

if __name__ == "__main__":
    print("looped_vs_baseline: not yet available (the benchmark lands with the model and kernels)")
    sys.exit(0)
