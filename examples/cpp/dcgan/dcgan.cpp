// A DCGAN trained as the public LibTorch example trains it, on generated 28x28 digits (no
// download): a generator of ConvTranspose2d/BatchNorm layers, a discriminator of Conv2d layers,
// one Adam optimizer each. The three lines marked "trainsan" are all TrainSan needs: one
// sanitizer watches both models, and tells their forwards apart by the optimizer whose
// parameters each reads. `dcgan --bug NAME` plants a bug.
#include <torch/torch.h>
#include <trainsan/trainsan.h>  // trainsan

#include <cstdio>
#include <string>

constexpr int64_t kNoiseSize = 100;
constexpr int64_t kBatchSize = 32;
constexpr int64_t kBatches = 12;

struct DCGANGeneratorImpl : torch::nn::Module {
  explicit DCGANGeneratorImpl(int64_t noise_size)
      : conv1(torch::nn::ConvTranspose2dOptions(noise_size, 128, 4).bias(false)),
        batch_norm1(128),
        conv2(torch::nn::ConvTranspose2dOptions(128, 64, 3).stride(2).padding(1).bias(false)),
        batch_norm2(64),
        conv3(torch::nn::ConvTranspose2dOptions(64, 32, 4).stride(2).padding(1).bias(false)),
        batch_norm3(32),
        conv4(torch::nn::ConvTranspose2dOptions(32, 1, 4).stride(2).padding(1).bias(false)) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv3", conv3);
    register_module("conv4", conv4);
    register_module("batch_norm1", batch_norm1);
    register_module("batch_norm2", batch_norm2);
    register_module("batch_norm3", batch_norm3);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(batch_norm1(conv1(x)));
    x = torch::relu(batch_norm2(conv2(x)));
    x = torch::relu(batch_norm3(conv3(x)));
    return torch::tanh(conv4(x));
  }

  torch::nn::ConvTranspose2d conv1, conv2, conv3, conv4;
  torch::nn::BatchNorm2d batch_norm1, batch_norm2, batch_norm3;
};
TORCH_MODULE(DCGANGenerator);

int main(int argc, char** argv) {
  std::string bug = argc > 2 && std::string(argv[1]) == "--bug" ? argv[2] : "";
  torch::manual_seed(1);
  DCGANGenerator generator(kNoiseSize);
  torch::nn::Sequential discriminator(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 4).stride(2).padding(1).bias(false)),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 4).stride(2).padding(1).bias(false)),
      torch::nn::BatchNorm2d(64),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 1, 7).stride(1).padding(0).bias(false)),
      torch::nn::Sigmoid());

  torch::optim::Adam generator_optimizer(generator->parameters(),
                                         torch::optim::AdamOptions(2e-4).betas({0.5, 0.5}));
  torch::optim::Adam discriminator_optimizer(discriminator->parameters(),
                                             torch::optim::AdamOptions(2e-4).betas({0.5, 0.5}));
  auto san = trainsan::attach({{"G", *generator, generator_optimizer}, {"D", *discriminator, discriminator_optimizer}});  // trainsan

  // "Real" images: a bright stroke at a random row, on a dark background, scaled to [-1, 1].
  auto real_batch = [] {
    auto images = torch::full({kBatchSize, 1, 28, 28}, -1.0);
    auto rows = torch::randint(4, 24, {kBatchSize});
    for (int64_t i = 0; i < kBatchSize; ++i) images[i][0][rows[i].item<int64_t>()].fill_(1.0);
    return images;
  };
  if (bug == "eval_mode") discriminator->eval();  // left in eval mode after a look at samples
  for (int64_t batch_index = 0; batch_index < kBatches; ++batch_index) {
    // Train discriminator with real images.
    discriminator->zero_grad();
    torch::Tensor real_images = real_batch();
    torch::Tensor real_labels = torch::empty(kBatchSize).uniform_(0.8, 1.0);
    torch::Tensor real_output = discriminator->forward(real_images).reshape(real_labels.sizes());
    torch::Tensor d_loss_real = torch::binary_cross_entropy(real_output, real_labels);
    d_loss_real.backward();

    // Train discriminator with fake images.
    torch::Tensor noise = torch::randn({kBatchSize, kNoiseSize, 1, 1});
    torch::Tensor fake_images;
    if (bug == "no_grad_generator") {
      torch::NoGradGuard no_grad;  // the samples are made without gradients: G never trains
      fake_images = generator->forward(noise);
    } else {
      fake_images = generator->forward(noise);
    }
    torch::Tensor fake_labels = torch::zeros(kBatchSize);
    torch::Tensor fake_output =
        discriminator->forward(fake_images.detach()).reshape(fake_labels.sizes());
    torch::Tensor d_loss_fake = torch::binary_cross_entropy(fake_output, fake_labels);
    d_loss_fake.backward();

    torch::Tensor d_loss = d_loss_real + d_loss_fake;
    discriminator_optimizer.step();

    // Train generator.
    generator->zero_grad();
    fake_labels.fill_(1);
    fake_output = discriminator->forward(fake_images).reshape(fake_labels.sizes());
    torch::Tensor g_loss = torch::binary_cross_entropy(fake_output, fake_labels);
    g_loss.backward();
    generator_optimizer.step();
    san.end_step({d_loss, g_loss});  // trainsan

    std::printf("\r[%2ld/%2ld] D_loss: %.4f | G_loss: %.4f", static_cast<long>(batch_index + 1),
                static_cast<long>(kBatches), d_loss.item<float>(), g_loss.item<float>());
  }
  std::printf("\n");
}
