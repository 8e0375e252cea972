"""The graft's projector: an image's encoder features to a few soft tokens in the language model's embedding
space, through a small MLP. Both models stay frozen; only this trains.

It starts in closed form: the first layer is a fixed random projection (scaled for unit-variance inputs), and
the second is the least-squares fit (ridge) from that layer's activations to target embeddings, the embeddings
of words that describe each training image (its colour and its shape): before any gradient step, the image
already reads to the language model like those words.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Projector(nn.Module):
    def __init__(self, feature_dim: int, hidden: int, tokens: int, width: int = 1024):
        super().__init__()
        self.tokens, self.hidden = tokens, hidden
        self.fc1 = nn.Linear(feature_dim, width)
        self.fc2 = nn.Linear(width, tokens * hidden)

    def activations(self, features: torch.Tensor) -> torch.Tensor:
        """[batch, channels, h, w] encoder features -> [batch, width]: the grid averaged, then the first layer."""
        return F.gelu(self.fc1(features.mean((2, 3))))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """-> [batch, tokens, hidden] soft tokens."""
        return self.fc2(self.activations(features)).view(-1, self.tokens, self.hidden)

    @torch.no_grad()
    def fit_least_squares(self, features: torch.Tensor, targets: torch.Tensor, ridge: float = 1e-2) -> float:
        """Set fc2 to the ridge least-squares map from `features`' activations to `targets` ([n, tokens, hidden]);
        returns the fit's mean squared error relative to the targets' variance."""
        acts = self.activations(features)
        x = torch.cat([acts, torch.ones(len(acts), 1)], 1).double()  # the bias as a constant column
        y = targets.reshape(len(targets), -1).double()
        gram = x.T @ x + ridge * len(x) * torch.eye(x.shape[1], dtype=x.dtype)
        solution = torch.linalg.solve(gram, x.T @ y)
        self.fc2.weight.copy_(solution[:-1].T.float())
        self.fc2.bias.copy_(solution[-1].float())
        residual = y - x @ solution
        return float(residual.pow(2).mean() / y.var())
