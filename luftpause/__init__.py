"""luftpause: the command line (`luftpause ...`).  The product's code lives in the
top-level packages: scheduler, gateway, workflows, activities, worker, testkit."""
