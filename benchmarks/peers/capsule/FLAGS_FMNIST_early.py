# FLAGS/FMNIST.py for littlefishe/Capsule at 9bd1c6c ("fix bugs", the milestones rule), written by
# benchmarks/peers/capsule/run.py into a temporary copy of their checkout. Modelled on their FLAGS/SVHN.py at that
# commit; every value that differs from it is marked, and matches raysplit's configs/semisfl/fmnist.yaml. run.py
# appends the per-run keys (round, stransform_type, iter_decay, seed, partition_file, eval_every) at the end.
#
# Note (their code, unchanged): ServerService.__init__ hard-codes self.sup_iters = 80 (server_utils.py:64); the
# supervised loop runs args.sup_iters steps and the EMA decay is ema_decay ** (self.sup_iters / args.sup_iters),
# i.e. 0.99 ** (80 / 20) = 0.961 here; the milestones rule (system_control) only changes self.sup_iters, so the
# adapted K_s reaches the EMA exponent, never the loop.

class config(object):
    def __init__(self) -> None:
        pass

FLAGS = config()
FLAGS.dataset_type = 'FMNIST'          # SVHN
FLAGS.model_type = 'CNNFMNIST'         # CNN (same layers, 1 input channel, 1024-dim embedding)
FLAGS.data_pattern = 0
FLAGS.worker_num = 30
FLAGS.active_worker_num = 10
FLAGS.round = 60                       # 1000
FLAGS.labeled_num = 1000
FLAGS.expand = True
FLAGS.pre_round = 0

# global
FLAGS.lr = 0.02
FLAGS.min_lr = 0.005
FLAGS.momentum = 0.9
FLAGS.weight_decay = 5e-4
FLAGS.decay_rate = 0

# server supervised hyperpara
FLAGS.stransform_type = 'twice'
FLAGS.sbatch_size = 32                 # 64
FLAGS.drop_last = True
FLAGS.ema_decay = 0.99
FLAGS.sup_iters = 20                   # 50 (K_s)
FLAGS.iter_decay = True

# local
FLAGS.utransform_type = 'fixmatch'
FLAGS.batch_size = 32                  # 64
FLAGS.local_steps = 10                 # 50 (K_u)

# cr
FLAGS.uqueue_size = 1024               # 2048 (HEAD and raysplit: 1024)
FLAGS.utemperature = 0.2
FLAGS.threshold = 0.95
FLAGS.cr_threshold = 0.95
FLAGS.emb_dim = 4*4*64                 # 5*5*64
FLAGS.proj_type = 'mlp'
FLAGS.proj_dim = 128


# alg
FLAGS.rho_1 = 0.01
FLAGS.rho_2 = 0.05
FLAGS.milestones = [20, 30, 40, 50]    # [150, 250, 400, 600, 700]; raysplit fmnist.yaml's milestones
FLAGS.pho1 = FLAGS.rho_1               # added: the names system_control reads (server_utils.py:326-328); their
FLAGS.pho2 = FLAGS.rho_2               #   FLAGS spell them rho_1/rho_2 (AttributeError at a milestone)
