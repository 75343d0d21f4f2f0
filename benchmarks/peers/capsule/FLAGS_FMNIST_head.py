# FLAGS/FMNIST.py for littlefishe/Capsule at 0c37252 (HEAD), written by benchmarks/peers/capsule/run.py into a
# temporary copy of their checkout. Modelled on their FLAGS/SVHN.py; every value that differs from it is marked, and
# matches raysplit's configs/semisfl/fmnist.yaml. run.py appends the per-run keys (round, labeled_num via --nlabeled,
# stransform_type, control, pre_round, seed, partition_file, eval_every, ctrl_every, ctrl_window) at the end.

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
FLAGS.client_labels = 0
FLAGS.mu = 7
FLAGS.expand = True
FLAGS.pre_round = 0

# global
FLAGS.lr = 0.02
FLAGS.min_lr = 0.005
FLAGS.momentum = 0.9
FLAGS.weight_decay = 5e-4

# server supervised hyperpara
FLAGS.stransform_type = 'twice'
FLAGS.sbz = 32                         # 64
FLAGS.drop_last = True
FLAGS.ema_decay = 0.99
FLAGS.global_steps = 20                # 100 (K_s initial)

# alg
FLAGS.control = True
FLAGS.alpha = 1.5
FLAGS.beta = 8

# local
FLAGS.utransform_type = 'fixmatch'
FLAGS.ubz = 32                         # 64
FLAGS.local_steps = 10                 # 50 (K_u)

# cr
FLAGS.queue_size = 1024
FLAGS.temperature = 0.2
FLAGS.threshold = 0.95
FLAGS.emb_dim = 4*4*64                 # 5*5*64
FLAGS.proj_type = 'mlp'
FLAGS.proj_dim = 128
FLAGS.clear_cache = False
