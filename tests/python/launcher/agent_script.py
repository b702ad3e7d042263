"""An actor-critic agent trained the way CleanRL-style PPO scripts train one (a launcher test
script): the Agent class has no forward(); the code calls agent.actor / agent.critic through
get_value / get_action_and_value, rollouts run under torch.no_grad() in train mode, one Adam
holds both heads.

    python agent_script.py [--iterations N] [--bug detached_value]

--bug detached_value: the value head's output is detached in the value loss, so the critic never
learns (TrainSan: missing_grad on critic.*).
"""

import argparse

import torch
from torch import nn
from torch.distributions import Categorical

parser = argparse.ArgumentParser()
parser.add_argument("--iterations", type=int, default=6)
parser.add_argument("--bug", choices=["detached_value"])
args = parser.parse_args()


class Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(obs_dim, 32), nn.Tanh(), nn.Linear(32, 1))
        self.actor = nn.Sequential(nn.Linear(obs_dim, 32), nn.Tanh(), nn.Linear(32, n_actions))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


torch.manual_seed(0)
agent = Agent(4, 2)
optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
num_steps, minibatch = 64, 16
for iteration in range(args.iterations):
    obs = torch.randn(num_steps, 4)
    with torch.no_grad():  # the rollout: no gradients, the agent stays in train mode
        actions, logprobs, _, values = agent.get_action_and_value(obs)
    rewards = torch.randn(num_steps)
    returns = rewards + 0.99 * values.flatten()
    advantages = returns - values.flatten()
    for start in range(0, num_steps, minibatch):
        mb = slice(start, start + minibatch)
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs[mb], actions[mb])
        if args.bug == "detached_value":
            newvalue = newvalue.detach()
        ratio = (newlogprob - logprobs[mb]).exp()
        pg_loss = torch.max(-advantages[mb] * ratio,
                            -advantages[mb] * ratio.clamp(0.8, 1.2)).mean()
        v_loss = 0.5 * ((newvalue.flatten() - returns[mb]) ** 2).mean()
        loss = pg_loss - 0.01 * entropy.mean() + 0.5 * v_loss
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
        optimizer.step()
print("done")
