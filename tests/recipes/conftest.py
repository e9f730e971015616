import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
if str(RECIPES) not in sys.path:  # config, data, model, pretrain import each other by plain name
    sys.path.insert(0, str(RECIPES))

# Import the heavy modules the recipe loads lazily (matplotlib for the plot, torch._dynamo via
# torch.optim) once here, so the ranks that the tests fork inherit them instead of importing each.
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401
