"""Classifier heads as libraries and public examples write them, with probabilities given to a
loss that applies softmax or sigmoid itself (probs_as_logits) and their honest twins; a launcher
test script (test_probs_as_logits.py).

    python probs_loops.py NAME [--steps N]

Each loop also runs under an explicit trainsan.attach: test_probs_as_logits.py imports this file
and calls LOOPS[name](attach), where attach(model, optimizer) returns a sanitizer.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 4


def no_attach(model, optimizer):
    return None


def images(n=256, classes=10, size=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, size, size, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def train(model, opt, attach, loader, loss_fn, steps):
    attach(model, opt)
    model.train()
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()


# ---------------------------------------------------------------------------------------------
# pytorch/examples' MNIST net, with the forward's last line as given


class MnistNet(nn.Module):
    def __init__(self, last="log_softmax"):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)
        self.last = last

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
        if self.last == "log_softmax":
            return F.log_softmax(x, dim=1)
        if self.last == "softmax":
            return F.softmax(x, dim=1)
        return x


def mnist_softmax_cross_entropy(attach, steps=STEPS):
    model = MnistNet("softmax")
    train(model, torch.optim.Adadelta(model.parameters(), lr=1.0), attach, images(),
          nn.CrossEntropyLoss(), steps)


def mnist_softmax_nll_loss(attach, steps=STEPS):
    model = MnistNet("softmax")
    train(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5), attach, images(),
          F.nll_loss, steps)


def mnist_log_softmax_nll_loss(attach, steps=STEPS):  # the example as written
    model = MnistNet("log_softmax")
    train(model, torch.optim.Adadelta(model.parameters(), lr=1.0), attach, images(), F.nll_loss,
          steps)


def mnist_log_softmax_cross_entropy(attach, steps=STEPS):  # harmless: log_softmax is idempotent
    model = MnistNet("log_softmax")
    train(model, torch.optim.Adadelta(model.parameters(), lr=1.0), attach, images(),
          nn.CrossEntropyLoss(), steps)


# ---------------------------------------------------------------------------------------------
# Keras-style Dense layers ported to torch


class Dense(nn.Module):
    def __init__(self, din, units, activation=None):
        super().__init__()
        self.kernel = nn.Linear(din, units)
        self.activation = activation

    def forward(self, x):
        h = self.kernel(x)
        if self.activation == "relu":
            return torch.relu(h)
        if self.activation == "softmax":
            return torch.softmax(h, dim=-1)
        if self.activation == "sigmoid":
            return torch.sigmoid(h)
        return h


def keras_model(last):
    return nn.Sequential(nn.Flatten(), Dense(144, 64, "relu"), Dense(64, 10, last))


def keras_softmax_ce_from_logits(attach, steps=STEPS):
    model = keras_model("softmax")
    train(model, torch.optim.Adam(model.parameters(), lr=1e-3), attach, images(),
          nn.CrossEntropyLoss(), steps)


def keras_softmax_log_then_nll(attach, steps=STEPS):  # from_logits=False done right
    model = keras_model("softmax")
    train(model, torch.optim.Adam(model.parameters(), lr=1e-3), attach, images(),
          lambda p, y: F.nll_loss(torch.log(p.clamp_min(1e-7)), y), steps)


def keras_binary(last, loss, attach, steps):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 20, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).float()[:, None]
    model = nn.Sequential(Dense(20, 32, "relu"), Dense(32, 1, last))
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    train(model, torch.optim.RMSprop(model.parameters(), lr=1e-3), attach, loader, loss, steps)


def keras_sigmoid_bce_with_logits(attach, steps=STEPS):
    keras_binary("sigmoid", nn.BCEWithLogitsLoss(), attach, steps)


def keras_sigmoid_bce(attach, steps=STEPS):  # the right pairing
    keras_binary("sigmoid", nn.BCELoss(), attach, steps)


def keras_logits_bce_with_logits(attach, steps=STEPS):
    keras_binary(None, nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0])), attach, steps)


def keras_relu_bce_with_logits(attach, steps=STEPS):  # unbounded above, half zeros: no sigmoid
    keras_binary("relu", nn.BCEWithLogitsLoss(), attach, steps)


# ---------------------------------------------------------------------------------------------
# torchvision-style classifier and a segmentation head


class TinyResNet(nn.Module):
    """torchvision's ResNet layout: stem, a residual block, global pooling, fc to logits."""

    def __init__(self, num_classes=10, zero_init_fc=False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                                   nn.Conv2d(16, 16, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(16))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, num_classes)
        if zero_init_fc:
            nn.init.zeros_(self.fc.weight)
            nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(x + self.block(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def torchvision_resnet_label_smoothing(attach, steps=STEPS):
    model = TinyResNet()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
          attach, images(), nn.CrossEntropyLoss(label_smoothing=0.1), steps)


def torchvision_resnet_zero_init_fc(attach, steps=STEPS):  # logits exactly 0 at first
    model = TinyResNet(zero_init_fc=True)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), attach, images(),
          nn.CrossEntropyLoss(), steps)


class SegNet(nn.Module):
    def __init__(self, classes=4, softmax=False):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, classes, 1))
        self.softmax = softmax

    def forward(self, x):
        out = self.body(x)
        return out.softmax(dim=1) if self.softmax else out


def segmentation(softmax, attach, steps):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 1, 12, 12, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 0] > 1).long()  # [N, H, W] per-pixel classes
    y[:, :2] = 255  # an unlabelled border
    model = SegNet(softmax=softmax)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    train(model, torch.optim.Adam(model.parameters(), lr=1e-3), attach, loader,
          nn.CrossEntropyLoss(ignore_index=255), steps)


def segmentation_softmax(attach, steps=STEPS):
    segmentation(True, attach, steps)


def segmentation_logits(attach, steps=STEPS):
    segmentation(False, attach, steps)


# ---------------------------------------------------------------------------------------------
# A Hugging Face-style sequence classifier: the loss inside forward


class SequenceClassifier(nn.Module):
    def __init__(self, vocab=50, d=32, num_labels=3, softmax_head=False):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.1, batch_first=True)
        self.classifier = nn.Linear(d, num_labels)
        self.num_labels = num_labels
        self.softmax_head = softmax_head

    def forward(self, input_ids, labels=None):
        pooled = self.encoder(self.embeddings(input_ids))[:, 0]
        logits = self.classifier(pooled)
        if self.softmax_head:
            logits = nn.functional.softmax(logits, dim=-1)
        loss = None
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss()
            loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
        return {"loss": loss, "logits": logits}


def hf_style(softmax_head, attach, steps):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (128, 16), generator=g)
    labels = ids[:, 1] % 3
    model = SequenceClassifier(softmax_head=softmax_head)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5)
    attach(model, opt)
    model.train()
    for step in range(steps):
        b = slice(16 * step, 16 * (step + 1))
        out = model(ids[b], labels=labels[b])
        out["loss"].backward()
        opt.step()
        opt.zero_grad()


def hf_style_logits(attach, steps=STEPS):
    hf_style(False, attach, steps)


def hf_style_softmax_head(attach, steps=STEPS):
    hf_style(True, attach, steps)


LOOPS = {f.__name__: f for f in [
    mnist_softmax_cross_entropy, mnist_softmax_nll_loss, keras_softmax_ce_from_logits,
    keras_sigmoid_bce_with_logits, segmentation_softmax, hf_style_softmax_head,
    mnist_log_softmax_nll_loss, mnist_log_softmax_cross_entropy, keras_softmax_log_then_nll,
    keras_sigmoid_bce, keras_logits_bce_with_logits, keras_relu_bce_with_logits,
    torchvision_resnet_label_smoothing, torchvision_resnet_zero_init_fc, segmentation_logits,
    hf_style_logits]}
BUGGY = ["mnist_softmax_cross_entropy", "mnist_softmax_nll_loss", "keras_softmax_ce_from_logits",
         "keras_sigmoid_bce_with_logits", "segmentation_softmax", "hf_style_softmax_head"]

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("name", choices=sorted(LOOPS))
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    torch.manual_seed(0)
    LOOPS[args.name](no_attach, args.steps)
    print("done", args.name)
