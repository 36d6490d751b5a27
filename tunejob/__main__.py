from tunejob.cli import main

main()
