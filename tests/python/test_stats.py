import torch

import trainsan


def test_hand_computed():
    t = torch.tensor([1.0, -2.0, 0.0, float("nan")])
    (s,) = trainsan.tensor_stats([t])
    assert (s.numel, s.nan, s.zero, s.min, s.max, s.sum) == (4, 1, 1, -2.0, 1.0, -1.0)
